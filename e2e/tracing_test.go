package e2e

import (
	"context"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
)

// TestOneTraceAcrossProcesses runs the real orders (API and relay) and
// shipping processes exporting to an OTLP/HTTP receiver of the test's own,
// and follows orders placed with a client traceparent and baggage:
//
//   - a sampled order gives one trace: the orders server span, the write
//     span, the event's create span (PRODUCER), whose context the message
//     carries, with its message id; the relay's publish span (CLIENT, with
//     the messaging attributes) and shipping's process span (CONSUMER) are both children
//     of the create span (the event is young) and link to it; the client's
//     allowed baggage is in the message shipping receives; each process
//     says which instance it is (service.instance.id) and its version
//     (service.version);
//   - an unsampled order records no span in either process, and the message
//     shipping applies still carries its trace id, unsampled, and baggage;
//   - the same message delivered again (as after a lost ack) is processed
//     as a duplicate in the original trace, under the same create span.
func TestOneTraceAcrossProcesses(t *testing.T) {
	amqpHost := requireServices(t, true)
	bins := buildBinaries(t)
	ctx, cancel := context.WithTimeout(t.Context(), 4*time.Minute)
	defer cancel()

	id, runDir := newRunDir(t, "tracing_")
	dbURL := replaceDatabase(testDatabaseURL(), id)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(t.Context()), time.Minute)
		defer cancel()
		conn, err := pgx.Connect(ctx, testDatabaseURL())
		if err != nil {
			t.Errorf("cleanup: drop database %s: %v", id, err)
			return
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, "DROP DATABASE IF EXISTS "+id+" WITH (FORCE)"); err != nil {
			t.Errorf("cleanup: drop database %s: %v", id, err)
		}
	})
	if err := rabbitmqctl(ctx, "add_vhost", id); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(t.Context()), time.Minute)
		defer cancel()
		if err := rabbitmqctl(ctx, "delete_vhost", id); err != nil {
			t.Errorf("cleanup: %v", err)
		}
	})
	if err := rabbitmqctl(ctx, "set_permissions", "-p", id, userOf(t, testAMQPURL()), ".*", ".*", ".*"); err != nil {
		t.Fatal(err)
	}
	amqpURL, err := withVhost(testAMQPURL(), amqpHost, id)
	if err != nil {
		t.Fatal(err)
	}

	recv, err := startOTLPReceiver()
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = recv.close()
		for _, err := range recv.problems() {
			t.Errorf("OTLP receiver: %v", err)
		}
	}()
	otel := func(service string) []string {
		return []string{
			"OTEL_EXPORTER_OTLP_ENDPOINT=" + recv.endpoint(), "OTEL_SERVICE_NAME=" + service,
			// Export within a moment rather than every 5s.
			"OTEL_BSP_SCHEDULE_DELAY=100",
		}
	}

	onExit := func(ev exitEvent) {
		t.Errorf("%s #%d exited on its own (%s):\n%s", ev.proc, ev.incarnation, ev.status, ev.logTail)
	}
	mongo, err := startLocalMongo(ctx, bins.MongoLocal, runDir, onExit)
	if err != nil {
		t.Fatal(err)
	}
	var procs []*proc
	defer func() {
		for _, p := range procs {
			if err := p.close(); err != nil {
				t.Errorf("cleanup: %v", err)
			}
		}
		if err := mongo.close(context.Background()); err != nil {
			t.Errorf("cleanup: stop MongoDB: %v", err)
		}
	}()

	ordersEnv := []string{"DATABASE_URL=" + dbURL, "AMQP_URL=" + amqpURL, "RELAY_POLL_INTERVAL=200ms", "LOG_LEVEL=info",
		"TRACE_BAGGAGE_KEYS=tenant"}
	migrate := exec.CommandContext(ctx, bins.Orders, "migrate")
	migrate.Env = append([]string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME")}, ordersEnv...)
	if out, err := migrate.CombinedOutput(); err != nil {
		t.Fatalf("orders migrate: %v\n%s", err, out)
	}
	shipAddr, err := freeAddr()
	if err != nil {
		t.Fatal(err)
	}
	ordersAddr, err := freeAddr()
	if err != nil {
		t.Fatal(err)
	}
	// Shipping first: it declares the queues the relay's publishes need.
	for _, spec := range []procSpec{{
		name: "shipping", bin: bins.Shipping,
		env: append([]string{"AMQP_URL=" + amqpURL, "MONGO_URI=mongodb://" + mongo.addr() + "/" + id,
			"HTTP_ADDR=" + shipAddr, "LOG_LEVEL=info"}, otel("shipping")...),
		readyURL: "http://" + shipAddr + "/readyz",
	}, {
		name: "orders", bin: bins.Orders,
		env:      append(append([]string{"HTTP_ADDR=" + ordersAddr}, ordersEnv...), otel("orders")...),
		readyURL: "http://" + ordersAddr + "/readyz",
	}} {
		p, err := newProc(spec, runDir, onExit)
		if err != nil {
			t.Fatal(err)
		}
		procs = append(procs, p)
		if _, err := p.start(); err != nil {
			t.Fatal(err)
		}
		if err := p.waitReady(ctx, time.Minute); err != nil {
			t.Fatal(err)
		}
	}

	// A tap: a queue of the test's own bound to every order event, so the
	// test sees each message as shipping receives it.
	tap := tapQueue(t, amqpURL)

	post := func(traceparent, baggage string) string {
		t.Helper()
		req, _ := http.NewRequestWithContext(ctx, "POST", "http://"+ordersAddr+"/orders",
			strings.NewReader(`{"customer_id":"c-trace","currency":"EUR","items":[{"sku":"s","quantity":1,"unit_price":100}]}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Traceparent", traceparent)
		if baggage != "" {
			req.Header.Set("Baggage", baggage)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusCreated {
			t.Fatalf("create: %d", resp.StatusCode)
		}
		return strings.TrimPrefix(resp.Header.Get("Location"), "/orders/")
	}
	// waitTrace waits until traceID holds a span that ok accepts.
	waitTrace := func(traceID, what string, ok func(recordedSpan) bool) []recordedSpan {
		t.Helper()
		deadline := time.Now().Add(time.Minute)
		for {
			spans := recv.trace(traceID)
			for _, s := range spans {
				if ok(s) {
					return spans
				}
			}
			if time.Now().After(deadline) {
				t.Fatalf("trace %s: no %s within a minute; spans: %v", traceID, what, spans)
			}
			sleep(ctx, 50*time.Millisecond)
		}
	}
	isProcess := func(s recordedSpan) bool {
		return s.Service == "shipping" && s.Kind == tracepb.Span_SPAN_KIND_CONSUMER && strings.HasPrefix(s.Name, "process ")
	}

	// 1. A sampled order: one trace, orders server span to shipping.
	const sampledTrace = "4bf92f3577b34da6a3ce929d0e0e4736"
	orderID := post("00-"+sampledTrace+"-00f067aa0ba902b7-01", "tenant=acme,session=s-91")
	msg := tap.next(t, orderID)
	// The processes export on their own schedules: wait for each one's.
	waitTrace(sampledTrace, "shipping process span", isProcess)
	waitTrace(sampledTrace, "orders server span", func(s recordedSpan) bool {
		return s.Service == "orders" && s.Kind == tracepb.Span_SPAN_KIND_SERVER
	})
	spans := waitTrace(sampledTrace, "relay publish span", func(s recordedSpan) bool {
		return s.Service == "orders" && s.Name == "publish orders.events"
	})
	one := func(pred func(recordedSpan) bool, what string) recordedSpan {
		t.Helper()
		var found []recordedSpan
		for _, s := range spans {
			if pred(s) {
				found = append(found, s)
			}
		}
		if len(found) != 1 {
			t.Fatalf("%d %s spans in the trace, want 1: %v", len(found), what, spans)
		}
		return found[0]
	}
	server := one(func(s recordedSpan) bool { return s.Service == "orders" && s.Kind == tracepb.Span_SPAN_KIND_SERVER }, "orders server")
	write := one(func(s recordedSpan) bool { return s.Service == "orders" && s.Name == "orders.create" }, "write")
	create := one(func(s recordedSpan) bool { return s.Service == "orders" && s.Name == "create orders.events" }, "create")
	publish := one(func(s recordedSpan) bool { return s.Service == "orders" && s.Name == "publish orders.events" }, "publish")
	process := one(isProcess, "shipping process")
	if server.Name != "POST /orders" || server.ParentID != "00f067aa0ba902b7" {
		t.Errorf("server span %v, want POST /orders under the client's span", server)
	}
	if write.ParentID != server.SpanID || write.Kind != tracepb.Span_SPAN_KIND_INTERNAL {
		t.Errorf("write span %v, want an internal child of the server span %s", write, server.SpanID)
	}
	if create.ParentID != write.SpanID || create.Kind != tracepb.Span_SPAN_KIND_PRODUCER || create.Attrs["messaging.operation.type"] != "create" {
		t.Errorf("create span %v (%v), want a producer create span under the write span %s", create, create.Attrs, write.SpanID)
	}
	if publish.ParentID != create.SpanID || !publish.linksTo(create) || publish.Kind != tracepb.Span_SPAN_KIND_CLIENT {
		t.Errorf("publish span %v (links %v), want a client child of the create span %s, linked to it", publish, publish.Links, create.SpanID)
	}
	if create.Attrs["messaging.message.id"] != msg.MessageId {
		t.Errorf("create span messaging.message.id %v, want the message's %s", create.Attrs["messaging.message.id"], msg.MessageId)
	}
	if process.Name != "process orders.events" || process.ParentID != create.SpanID || !process.linksTo(create) {
		t.Errorf("shipping process span %v (links %v), want process orders.events, a child of the create span %s, linked to it", process, process.Links, create.SpanID)
	}
	if process.Attrs["messaging.destination.name"] != "orders.events" || process.Attrs["messaging.destination.subscription.name"] != "shipping.order-events" {
		t.Errorf("process span destination %v, subscription %v", process.Attrs["messaging.destination.name"], process.Attrs["messaging.destination.subscription.name"])
	}
	for _, s := range []recordedSpan{server, publish, process} {
		if len(s.Instance) != 36 {
			t.Errorf("%v: service.instance.id %q, want a UUID of the process", s, s.Instance)
		}
		if s.Version == "" || s.Version == "<nil>" {
			t.Errorf("%v: no service.version", s)
		}
	}
	if server.Instance != publish.Instance || server.Instance == process.Instance {
		t.Errorf("instances: orders API %s, its relay %s, shipping %s: want one per process", server.Instance, publish.Instance, process.Instance)
	}
	for k, want := range map[string]any{
		"messaging.system": "rabbitmq", "messaging.operation.type": "send", "messaging.destination.name": "orders.events",
		"messaging.rabbitmq.destination.routing_key": "order.created", "messaging.message.id": msg.MessageId,
	} {
		if publish.Attrs[k] != want {
			t.Errorf("publish span %s = %v, want %v", k, publish.Attrs[k], want)
		}
	}
	for k, want := range map[string]any{
		"messaging.system": "rabbitmq", "messaging.operation.type": "process", "messaging.message.id": msg.MessageId,
	} {
		if process.Attrs[k] != want {
			t.Errorf("process span %s = %v, want %v", k, process.Attrs[k], want)
		}
	}
	if got := msg.Headers["traceparent"]; got != "00-"+sampledTrace+"-"+create.SpanID+"-01" {
		t.Errorf("the message's traceparent %v, want the create span's", got)
	}
	if got := msg.Headers["baggage"]; got != "tenant=acme" {
		t.Errorf("the message's baggage %v, want the client's tenant=acme alone (TRACE_BAGGAGE_KEYS=tenant)", got)
	}

	// 2. An unsampled order: no span anywhere, its context still travels.
	const unsampledTrace = "0af7651916cd43dd8448eb211c80319c"
	unsampledID := post("00-"+unsampledTrace+"-b7ad6b7169203331-00", "tenant=beta")
	um := tap.next(t, unsampledID)
	if tp, _ := um.Headers["traceparent"].(string); !strings.HasPrefix(tp, "00-"+unsampledTrace+"-") || !strings.HasSuffix(tp, "-00") || um.Headers["baggage"] != "tenant=beta" {
		t.Errorf("unsampled order's message headers %v, want its trace id, flags 00 and its baggage", um.Headers)
	}
	waitApplied(ctx, t, mongo.addr(), id, unsampledID)
	// A later sampled order, processed after the unsampled one was applied:
	// once its process span is in, anything of the unsampled trace would be.
	const laterTrace = "abababababababababababababababab"
	laterID := post("00-"+laterTrace+"-00f067aa0ba902b7-01", "")
	tap.next(t, laterID)
	waitTrace(laterTrace, "shipping process span", isProcess)

	// 3. The first order's message delivered again: a duplicate, in the
	// original trace, under the same create span.
	dup := amqp.Publishing{
		Headers: msg.Headers, ContentType: msg.ContentType, DeliveryMode: amqp.Persistent,
		MessageId: msg.MessageId, Timestamp: msg.Timestamp, Type: msg.Type, Body: msg.Body,
	}
	if err := publishConfirmed(ctx, amqpURL, exchange, dup, msg.RoutingKey); err != nil {
		t.Fatal(err)
	}
	spans = waitTrace(sampledTrace, "second shipping process span", func(s recordedSpan) bool {
		return isProcess(s) && s.SpanID != process.SpanID
	})
	for _, s := range spans {
		if isProcess(s) && s.SpanID != process.SpanID && s.ParentID != create.SpanID {
			t.Errorf("the redelivered copy's process span %v, want a child of the create span %s", s, create.SpanID)
		}
	}
	waitTrace(sampledTrace, "span marking the duplicate", func(s recordedSpan) bool {
		return s.Service == "shipping" && s.Attrs["inbox.duplicate"] == true
	})
	if got := recv.trace(unsampledTrace); len(got) != 0 {
		t.Errorf("the unsampled order recorded spans: %v", got)
	}
}

// tap is a queue of the test's own bound to the orders events.
type tap struct {
	d    <-chan amqp.Delivery
	seen map[string]amqp.Delivery
}

func tapQueue(t *testing.T, amqpURL string) *tap {
	t.Helper()
	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.ExchangeDeclare(exchange, "topic", true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	q, err := ch.QueueDeclare("", false, true, true, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.QueueBind(q.Name, "order.*", exchange, false, nil); err != nil {
		t.Fatal(err)
	}
	d, err := ch.Consume(q.Name, "", true, true, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	return &tap{d: d, seen: map[string]amqp.Delivery{}}
}

// next returns the tapped message of the order's created event.
func (tp *tap) next(t *testing.T, orderID string) amqp.Delivery {
	t.Helper()
	timeout := time.After(time.Minute)
	for {
		if m, ok := tp.seen[orderID]; ok {
			return m
		}
		select {
		case m := <-tp.d:
			if id, _ := m.Headers["aggregate_id"].(string); id != "" && m.Type == "order.created" {
				tp.seen[id] = m
			}
		case <-timeout:
			t.Fatalf("order %s: no order.created message within a minute", orderID)
		}
	}
}

// waitApplied waits until shipping applied the order's created event.
func waitApplied(ctx context.Context, t *testing.T, mongoAddr, database, orderID string) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		shipments, err := readShipments(ctx, "mongodb://"+mongoAddr+"/", database, shipmentsCollection)
		if err != nil {
			t.Fatal(err)
		}
		if len(shipments[orderID].Events) > 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("shipping did not apply order %s within a minute", orderID)
		}
		sleep(ctx, 100*time.Millisecond)
	}
}
