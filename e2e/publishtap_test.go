package e2e

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/e2e/chaos"
)

const (
	// publishTapQueue is the harness's own queue in the run's vhost: bound
	// to the orders exchange like shipping's queue (shipping's
	// rabbitmq.Topology BindingKey), it receives a copy of every event a
	// relay routes, in the order the broker routed them.
	publishTapQueue = "chaos.publish-order-tap"
	// shippingBindingKey binds shipping's queue to the orders exchange.
	shippingBindingKey = "order.*"
	// publishTapConnName names the tap's connection.
	publishTapConnName = "chaos-publish-order-tap"
)

// publishTap consumes publishTapQueue for the checker's I3 on the order of
// publication (chaos.PublishOrder): it numbers the deliveries it reads 1,
// 2, ... and keeps, per message id, the numbers of its first and last
// copies.
//
// It connects straight to the broker (no toxiproxy: the proxy faults are
// the services'), acks each delivery after it is numbered, and connects
// again whenever its connection is lost (broker_close_connections cuts
// every connection of the vhost, broker_app_restart and the node faults
// the broker's): a delivery read before the loss was numbered, one not
// acked goes back to the queue and is delivered again, a second copy. The
// queue must lose nothing a relay routed to it, or a copy it lost and a
// relay sent again later would be a first copy out of place: on one node
// the machine's broker it is a durable classic queue (a broker restart
// keeps it and its persistent messages), on a broker of the run's own (one
// node, or a cluster) a quorum queue, with a member on every node as
// shipping's, so that no node fault takes it away. A copy the queue had
// handed out before comes with the redelivered flag, kept for a first copy
// (chaos.Sighting.FirstRedelivered): it was routed before it was seen.
type publishTap struct {
	urls   []string // direct, the run's vhost; tried in turn
	quorum bool
	logf   func(string, ...any)

	mu         sync.Mutex
	seq        int64
	byID       map[string]int
	sightings  []chaos.Sighting
	reconnects int

	cancel context.CancelFunc
	done   chan struct{}
}

// startPublishTap declares the tap (and the orders exchange, as shipping
// and the relays declare it) and consumes it until stop.
func startPublishTap(ctx context.Context, urls []string, quorum bool, logf func(string, ...any)) (*publishTap, error) {
	p := &publishTap{urls: urls, quorum: quorum, logf: logf, byID: make(map[string]int), done: make(chan struct{})}
	conn, ch, err := p.connect(0)
	if err != nil {
		return nil, fmt.Errorf("publish-order tap: %w", err)
	}
	ctx, p.cancel = context.WithCancel(context.WithoutCancel(ctx))
	go p.run(ctx, conn, ch)
	return p, nil
}

func (p *publishTap) connect(attempt int) (*amqp.Connection, *amqp.Channel, error) {
	url := p.urls[attempt%len(p.urls)]
	conn, err := amqp.DialConfig(url, amqp.Config{
		Dial: amqp.DefaultDial(5 * time.Second), Heartbeat: 5 * time.Second,
		Properties: amqp.Table{"connection_name": publishTapConnName},
	})
	if err != nil {
		return nil, nil, fmt.Errorf("connect: %w", err)
	}
	ch, err := conn.Channel()
	if err == nil {
		err = p.declare(ch)
	}
	if err != nil {
		_ = conn.Close()
		return nil, nil, err
	}
	return conn, ch, nil
}

func (p *publishTap) declare(ch *amqp.Channel) error {
	args := amqp.Table{"x-queue-type": "classic"}
	if p.quorum {
		// A copy given back more often than that would be dropped. One
		// active consumer: a new connection's consumer waits until the
		// queue has dropped the lost one and given its copy back.
		args = amqp.Table{"x-queue-type": "quorum", "x-delivery-limit": int64(1_000_000),
			"x-single-active-consumer": true}
	}
	if err := ch.ExchangeDeclare(exchange, amqp.ExchangeTopic, true, false, false, false, nil); err != nil {
		return fmt.Errorf("declare exchange %s: %w", exchange, err)
	}
	if _, err := ch.QueueDeclare(publishTapQueue, true, false, false, false, args); err != nil {
		return fmt.Errorf("declare queue %s: %w", publishTapQueue, err)
	}
	if err := ch.QueueBind(publishTapQueue, shippingBindingKey, exchange, false, nil); err != nil {
		return fmt.Errorf("bind queue %s: %w", publishTapQueue, err)
	}
	// A classic queue puts what a lost connection gives back at its place
	// in the queue; a quorum queue gives it back ahead of the rest, in an
	// order of its own: one delivery in flight and one active consumer
	// keep the first copies in routing order there. Without the single
	// active consumer, the queue could hold the lost connection's consumer
	// beside the new one until it learns that it is gone: a copy handed to
	// it came back, redelivered, after the next one (the checker excuses
	// an inversion whose first copy came redelivered and counts it).
	prefetch := 200
	if p.quorum {
		prefetch = 1
	}
	return ch.Qos(prefetch, 0, false)
}

// run consumes until ctx ends, connecting again after each loss.
func (p *publishTap) run(ctx context.Context, conn *amqp.Connection, ch *amqp.Channel) {
	defer close(p.done)
	for attempt := 0; ; {
		if conn != nil {
			err := p.consume(ctx, ch)
			_ = conn.Close()
			if ctx.Err() != nil {
				return
			}
			p.logf("publish-order tap: connection lost (%v); connecting again", err)
			p.mu.Lock()
			p.reconnects++
			p.mu.Unlock()
			conn = nil
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(200 * time.Millisecond):
		}
		attempt++
		var err error
		if conn, ch, err = p.connect(attempt); err != nil {
			conn = nil
			if attempt%25 == 0 {
				p.logf("publish-order tap: %v; trying again", err)
			}
		}
	}
}

func (p *publishTap) consume(ctx context.Context, ch *amqp.Channel) error {
	ds, err := ch.Consume(publishTapQueue, "", false, false, false, false, nil)
	if err != nil {
		return fmt.Errorf("consume %s: %w", publishTapQueue, err)
	}
	closed := ch.NotifyClose(make(chan *amqp.Error, 1))
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case e := <-closed:
			if e == nil {
				return errors.New("channel closed")
			}
			return fmt.Errorf("channel closed: %w", e)
		case d, ok := <-ds:
			if !ok {
				return errors.New("deliveries closed")
			}
			p.sight(d.MessageId, d.Redelivered)
			if err := d.Ack(false); err != nil {
				return fmt.Errorf("ack: %w", err)
			}
		}
	}
}

func (p *publishTap) sight(id string, redelivered bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.seq++
	if id == "" {
		return // a poison message without an id
	}
	i, ok := p.byID[id]
	if !ok {
		p.byID[id] = len(p.sightings)
		p.sightings = append(p.sightings, chaos.Sighting{MessageID: id, First: p.seq, Last: p.seq, Copies: 1, FirstRedelivered: redelivered})
		return
	}
	p.sightings[i].Last = p.seq
	p.sightings[i].Copies++
}

func (p *publishTap) count() int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.seq
}

// finish waits, after the drain, until the tap's queue is empty and
// nothing more came for a second (or ctx ends), stops consuming and returns
// what it saw.
func (p *publishTap) finish(ctx context.Context) (*chaos.PublishOrder, error) {
	var waitErr error
	deadline := time.Now().Add(time.Minute)
	for last := int64(-1); ; {
		n := p.count()
		ready, err := readyCounts(ctx, p.urls[0], publishTapQueue)
		if err == nil && ready[publishTapQueue] == 0 && n == last {
			break
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			waitErr = fmt.Errorf("publish-order tap: %d ready after a minute (%v)", ready[publishTapQueue], err)
			break
		}
		last = n
		sleep(ctx, time.Second)
	}
	p.stop()
	p.mu.Lock()
	defer p.mu.Unlock()
	return &chaos.PublishOrder{Sightings: p.sightings, Reconnects: p.reconnects}, waitErr
}

// stop ends the consumer; safe to call more than once.
func (p *publishTap) stop() {
	p.cancel()
	<-p.done
}

// directAMQPURLs are the run's vhost on each broker node, straight.
func (c *cluster) directAMQPURLs() ([]string, error) {
	if c.rabbit == nil {
		return []string{c.amqpURL}, nil
	}
	urls, err := c.amqpURLs(strings.Join(c.rabbit.addrs(), ","))
	if err != nil {
		return nil, err
	}
	return strings.Split(urls, ","), nil
}
