package e2e

import (
	"context"
	"os"
	"slices"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// The run's own RabbitMQ cluster: three nodes clustered, a quorum queue
// replicated on each, its leader found, killed and restarted, publishing
// confirmed meanwhile through the other nodes, and every node stopped at the
// end. It starts three Erlang VMs, so it runs with the cluster profile only
// (make chaos-cluster), not in make test.
func TestRabbitCluster(t *testing.T) {
	if os.Getenv("CHAOS_PROFILE") != "cluster" {
		t.Skip("starts three RabbitMQ nodes: runs with CHAOS_PROFILE=cluster (make chaos-cluster)")
	}
	if err := rabbitClusterAvailable(); err != nil {
		unavailable(t, "no RabbitMQ cluster of the test's own here: %v", err)
	}
	ctx := t.Context()
	dir := t.TempDir()
	netns := netnsAvailable()
	if netns != nil {
		t.Logf("nodes on loopback, no partition: %v", netns)
	}
	rc, err := startRabbitCluster(ctx, "chaostest", dir, 3, netns == nil, func(ev exitEvent) {
		t.Errorf("node exited on its own: %+v", ev)
	}, t.Logf)
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	defer func() {
		if !closed {
			_ = rc.close(context.WithoutCancel(ctx))
		}
	}()
	const vhost, queue = "chaostest", "q"
	for _, args := range [][]string{{"add_vhost", vhost}, {"set_permissions", "-p", vhost, "guest", ".*", ".*", ".*"}} {
		if _, err := rc.ctl(ctx, args...); err != nil {
			t.Fatal(err)
		}
	}
	var urls []string
	for _, a := range rc.addrs() {
		u, err := withVhost(testAMQPURL(), a, vhost)
		if err != nil {
			t.Fatal(err)
		}
		urls = append(urls, u)
	}
	nacks := 0

	// publish sends n messages through url, each until it is confirmed. A
	// nack (no leader while one is elected) is retried on a new channel, as
	// the relay would: a channel that saw a quorum queue's nack during an
	// election kept nacking on RabbitMQ 3.10 (seen here for minutes).
	publish := func(url string, n int) {
		t.Helper()
		deadline := time.Now().Add(2 * time.Minute)
		for sent := 0; sent < n; {
			if time.Now().After(deadline) {
				t.Fatalf("publish through %s: not confirmed for 2 minutes", url)
			}
			acked, err := publishOne(ctx, url, queue)
			if err != nil {
				t.Logf("publish through %s: %v", url, err)
				time.Sleep(200 * time.Millisecond)
				continue
			}
			if !acked {
				nacks++
				time.Sleep(200 * time.Millisecond)
				continue
			}
			sent++
		}
	}
	publish(urls[0], 5)
	states, err := rc.queueStates(ctx, vhost, queue)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range rc.names() {
		if !slices.Contains(states[queue].members, name) {
			t.Errorf("queue %s: members %v miss %s", queue, states[queue].members, name)
		}
	}
	leader, err := rc.leader(ctx, vhost, queue)
	if err != nil {
		t.Fatal(err)
	}
	n, err := rc.node(leader)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("leader of %s: %s (%s)", queue, leader, n.name)
	n.p.kill()
	// The majority goes on: a confirmed publish through another node.
	publish(urls[n.i%3], 5)
	t.Logf("%d nacks while the leader was re-elected", nacks)
	if err := n.awaitStartup(ctx); err != nil {
		t.Fatal(err)
	}
	if err := rc.stopApp(ctx, n); err != nil {
		t.Fatal(err)
	}
	publish(urls[n.i%3], 5)
	if err := rc.heal(ctx); err != nil {
		t.Fatal(err)
	}
	want := 15
	if rc.net != nil {
		// A partition (nodes in network namespaces): the queue's leader cut
		// from the other two pauses itself (pause_minority); publishing
		// through the majority goes on, and the node comes back once the
		// partition heals.
		leader, err := rc.leader(ctx, vhost, queue)
		if err != nil {
			t.Fatal(err)
		}
		ln, err := rc.node(leader)
		if err != nil {
			t.Fatal(err)
		}
		how, err := rc.partitionNode(ctx, ln, func() error {
			publish(urls[ln.i%3], 5)
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		after, _ := rc.leader(ctx, vhost, queue)
		t.Logf("partition of %s (leader of %s): %s; leader now %s", ln.name, queue, how, after)
		want += 5
	}
	states, err = rc.queueStates(ctx, vhost, queue)
	if err != nil {
		t.Fatal(err)
	}
	if st, ok := states[queue]; !ok || st.messages != want {
		t.Errorf("after the faults: %+v, want %s with %d messages", states, queue, want)
	}
	closed = true
	if err := rc.close(ctx); err != nil {
		t.Fatal(err)
	}
	for _, node := range rc.nodes {
		if node.p.current() != nil {
			t.Errorf("%s still running after close", node.name)
		}
	}
}

// publishOne declares queue (quorum) and publishes one persistent message to
// it on a connection of its own, and returns the broker's confirm.
func publishOne(ctx context.Context, url, queue string) (bool, error) {
	conn, err := amqp.DialConfig(url, amqp.Config{Dial: amqp.DefaultDial(10 * time.Second)})
	if err != nil {
		return false, err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return false, err
	}
	if _, err := ch.QueueDeclare(queue, true, false, false, false, amqp.Table{"x-queue-type": "quorum"}); err != nil {
		return false, err
	}
	if err := ch.Confirm(false); err != nil {
		return false, err
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, true, false, amqp.Publishing{Body: []byte("x"), DeliveryMode: amqp.Persistent})
	if err != nil {
		return false, err
	}
	return dc.WaitContext(ctx)
}
