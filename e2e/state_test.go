package e2e

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"

	"github.com/outbox-inbox/reference/e2e/chaos"
	"github.com/outbox-inbox/reference/pkg/outbox"
)

// readOrders returns every order row of the run's database.
func readOrders(ctx context.Context, db *pgxpool.Pool) ([]chaos.CommittedOrder, error) {
	rows, err := db.Query(ctx, `SELECT id::text, customer_id, status, version FROM orders`)
	if err != nil {
		return nil, fmt.Errorf("read orders: %w", err)
	}
	var out []chaos.CommittedOrder
	for rows.Next() {
		var o chaos.CommittedOrder
		if err := rows.Scan(&o.ID, &o.Key, &o.Status, &o.Version); err != nil {
			rows.Close()
			return nil, fmt.Errorf("read orders: %w", err)
		}
		out = append(out, o)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read orders: %w", err)
	}
	return out, nil
}

// readEvents returns every outbox row, published or not, and how many are
// still waiting for the relay (pending, not dead-lettered).
func readEvents(ctx context.Context, db *pgxpool.Pool) ([]chaos.CommittedEvent, int, error) {
	rows, err := db.Query(ctx, `
		SELECT id, created_at, aggregate_id, aggregate_version, event_type, coalesce(payload->>'note', ''), dead_lettered_at IS NOT NULL, true, NULL::timestamptz FROM outbox
		UNION ALL
		SELECT id, created_at, aggregate_id, aggregate_version, event_type, coalesce(payload->>'note', ''), false, false, published_at FROM outbox_published`)
	if err != nil {
		return nil, 0, fmt.Errorf("read outbox: %w", err)
	}
	var (
		out     []chaos.CommittedEvent
		pending int
	)
	for rows.Next() {
		var (
			e         chaos.CommittedEvent
			id        int64
			createdAt time.Time
			unmarked  bool
			published *time.Time
		)
		if err := rows.Scan(&id, &createdAt, &e.OrderID, &e.Version, &e.Type, &e.Note, &e.DeadLettered, &unmarked, &published); err != nil {
			rows.Close()
			return nil, 0, fmt.Errorf("read outbox: %w", err)
		}
		e.MessageID, e.CreatedAt = outbox.MessageID(id, createdAt), createdAt
		if published != nil {
			e.PublishedAt = *published
		}
		if unmarked && !e.DeadLettered {
			pending++
		}
		out = append(out, e)
	}
	if err := rows.Err(); err != nil {
		return nil, 0, fmt.Errorf("read outbox: %w", err)
	}
	return out, pending, nil
}

// shipmentReader asks the shipping API for shipments, trying each consumer
// in turn (one may be down).
type shipmentReader struct {
	urls   []string
	client *http.Client
}

// get returns the shipment of orderID; a 404 is an empty shipment.
func (r *shipmentReader) get(ctx context.Context, orderID string) (chaos.Shipment, error) {
	var errs []error
	for _, base := range r.urls {
		sh, err := r.getFrom(ctx, base, orderID)
		if err == nil {
			return sh, nil
		}
		errs = append(errs, err)
	}
	return chaos.Shipment{}, errors.Join(errs...)
}

func (r *shipmentReader) getFrom(ctx context.Context, base, orderID string) (chaos.Shipment, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/shipments/"+orderID, nil)
	if err != nil {
		return chaos.Shipment{}, err
	}
	resp, err := r.client.Do(req)
	if err != nil {
		return chaos.Shipment{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return chaos.Shipment{}, err
	}
	switch resp.StatusCode {
	case http.StatusOK:
	case http.StatusNotFound:
		return chaos.Shipment{OrderID: orderID}, nil
	default:
		return chaos.Shipment{}, fmt.Errorf("GET %s/shipments/%s: HTTP %d: %s", base, orderID, resp.StatusCode, strings.TrimSpace(string(b)))
	}
	var sh chaos.Shipment
	if err := json.Unmarshal(b, &sh); err != nil {
		return chaos.Shipment{}, fmt.Errorf("GET %s/shipments/%s: %w in %q", base, orderID, err, b)
	}
	if sh.OrderID != orderID {
		return chaos.Shipment{}, fmt.Errorf("GET %s/shipments/%s answered the shipment of %q", base, orderID, sh.OrderID)
	}
	return sh, nil
}

// getAll reads the shipments of ids with a few requests in flight.
func (r *shipmentReader) getAll(ctx context.Context, ids []string) (map[string]chaos.Shipment, error) {
	out := make(map[string]chaos.Shipment, len(ids))
	var (
		mu   sync.Mutex
		errs []error
		wg   sync.WaitGroup
	)
	sem := make(chan struct{}, 4)
	for _, id := range ids {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			sh, err := r.get(ctx, id)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, err)
				return
			}
			out[id] = sh
		})
	}
	wg.Wait()
	if len(errs) > 0 {
		return out, fmt.Errorf("%d shipments unreadable, first: %w", len(errs), errs[0])
	}
	return out, nil
}

// queueDepths returns messages (ready + unacknowledged) per queue of the
// run's vhost, on the run's own cluster when it has one.
func (c *cluster) queueDepths(ctx context.Context) (map[string]int, error) {
	if c.rabbit != nil {
		// shipping's queues, from their Raft groups (queueStates: list_queues
		// timed out on a busy quorum queue there).
		states, err := c.rabbit.queueStates(ctx, c.vhost, shippingQueues...)
		if err != nil {
			return nil, err
		}
		depths := make(map[string]int)
		for _, q := range shippingQueues {
			st, ok := states[q]
			if !ok {
				return nil, fmt.Errorf("queue %s of vhost %s not declared or not answering", q, c.vhost)
			}
			depths[q] = st.messages
		}
		return depths, nil
	}
	out, err := rabbitmqctlOutput(ctx, "list_queues", "-p", c.vhost, "--no-table-headers", "name", "messages")
	if err != nil {
		return nil, err
	}
	depths := make(map[string]int)
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) != 2 {
			continue
		}
		n, err := strconv.Atoi(f[1])
		if err != nil {
			continue
		}
		depths[f[0]] = n
	}
	return depths, nil
}

// drainDeadLetters takes every message off the dead-letter queue.
func drainDeadLetters(ctx context.Context, amqpURL, queue, reasonHeader string) ([]chaos.DeadLetter, error) {
	conn, err := amqp.DialConfig(amqpURL, amqp.Config{Dial: amqp.DefaultDial(10 * time.Second)})
	if err != nil {
		return nil, fmt.Errorf("read dead letters: %w", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("read dead letters: %w", err)
	}
	defer ch.Close()
	var out []chaos.DeadLetter
	for ctx.Err() == nil {
		d, ok, err := ch.Get(queue, true)
		if err != nil {
			return out, fmt.Errorf("read dead letters from %s: %w", queue, err)
		}
		if !ok {
			return out, nil
		}
		dl := chaos.DeadLetter{MessageID: d.MessageId, RoutingKey: d.RoutingKey, Reason: headerString(d.Headers, reasonHeader)}
		dl.PoisonID = headerString(d.Headers, chaos.PoisonHeader)
		if dl.Reason == "" {
			dl.Reason = deathReason(d.Headers)
		}
		if rk := originalRoutingKey(d.Headers); rk != "" {
			dl.RoutingKey = rk
		}
		out = append(out, dl)
	}
	return out, ctx.Err()
}

func headerString(h amqp.Table, key string) string {
	if key == "" {
		return ""
	}
	switch v := h[key].(type) {
	case string:
		return v
	case []byte:
		return string(v)
	case nil:
		return ""
	default:
		return fmt.Sprint(v)
	}
}

// deathReason is the reason RabbitMQ recorded in x-death when the consumer
// rejected the message into a dead-letter exchange.
func deathReason(h amqp.Table) string {
	deaths, _ := h["x-death"].([]any)
	for _, d := range deaths {
		if t, ok := d.(amqp.Table); ok {
			if r, ok := t["reason"].(string); ok && r != "" {
				return r
			}
		}
	}
	return ""
}

func originalRoutingKey(h amqp.Table) string {
	deaths, _ := h["x-death"].([]any)
	for _, d := range deaths {
		if t, ok := d.(amqp.Table); ok {
			if keys, ok := t["routing-keys"].([]any); ok && len(keys) > 0 {
				if s, ok := keys[0].(string); ok {
					return s
				}
			}
		}
	}
	return ""
}

// scrapeCounter returns the sum of a Prometheus counter's samples (over its
// labels) in a text exposition, and whether the metric was present.
func scrapeCounter(exposition, name string) (float64, bool) {
	var sum float64
	found := false
	for line := range strings.SplitSeq(exposition, "\n") {
		if strings.HasPrefix(line, "#") {
			continue
		}
		rest, ok := strings.CutPrefix(line, name)
		if !ok || rest == "" || (rest[0] != ' ' && rest[0] != '{') {
			continue
		}
		f := strings.Fields(rest[strings.LastIndex(rest, "}")+1:])
		if len(f) == 0 {
			continue
		}
		v, err := strconv.ParseFloat(f[0], 64)
		if err != nil {
			continue
		}
		sum += v
		found = true
	}
	return sum, found
}

// shipmentRecord is one applied event as shipping stores it
// (services/shipping/internal/mongodb: one document per order and version).
type shipmentRecord struct {
	OrderID   string    `bson:"order_id"`
	Version   int64     `bson:"version"`
	MessageID string    `bson:"message_id"`
	EventType string    `bson:"event_type"`
	AppliedAt time.Time `bson:"applied_at"`
	Discarded bool      `bson:"discarded"`
}

// readShipments reads every applied event from shipping's MongoDB collection
// in one query and groups them into shipments, each in applied order
// (applied_at, then version). Asking the API order by order costs minutes
// on FerretDB; finalState cross-checks a sample against the API.
func readShipments(ctx context.Context, uri, database, collection string) (map[string]chaos.Shipment, error) {
	client, err := mongo.Connect(options.Client().ApplyURI(uri).SetServerSelectionTimeout(30 * time.Second))
	if err != nil {
		return nil, fmt.Errorf("read shipments: %w", err)
	}
	defer func() { _ = client.Disconnect(context.WithoutCancel(ctx)) }()
	cur, err := client.Database(database).Collection(collection).Find(ctx, bson.D{})
	if err != nil {
		return nil, fmt.Errorf("read shipments: %w", err)
	}
	var recs []shipmentRecord
	if err := cur.All(ctx, &recs); err != nil {
		return nil, fmt.Errorf("read shipments: %w", err)
	}
	slices.SortStableFunc(recs, func(a, b shipmentRecord) int {
		return cmp.Or(strings.Compare(a.OrderID, b.OrderID), a.AppliedAt.Compare(b.AppliedAt), cmp.Compare(a.Version, b.Version))
	})
	out := make(map[string]chaos.Shipment)
	for _, r := range recs {
		if r.Discarded || (r.EventType != chaos.EventCreated && r.EventType != chaos.EventAmended && r.EventType != chaos.EventCancelled) {
			// A no-op: an event type shipping ignores, recorded at its
			// version so that later versions apply, or a version an operator
			// discarded. No effect.
			continue
		}
		sh := out[r.OrderID]
		sh.OrderID = r.OrderID
		sh.Events = append(sh.Events, chaos.AppliedEvent{MessageID: r.MessageID, EventType: r.EventType, Version: r.Version})
		out[r.OrderID] = sh
	}
	return out, nil
}

// readyCounts returns the ready messages of each queue, from a passive
// declare: cheap, but blind to unacknowledged messages.
func readyCounts(ctx context.Context, amqpURL string, queues ...string) (map[string]int, error) {
	conn, err := amqp.DialConfig(amqpURL, amqp.Config{Dial: amqp.DefaultDial(5 * time.Second)})
	if err != nil {
		return nil, fmt.Errorf("count ready messages: %w", err)
	}
	defer conn.Close()
	out := make(map[string]int, len(queues))
	for _, q := range queues {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		// A failed passive declare closes the channel: one channel per queue.
		ch, err := conn.Channel()
		if err != nil {
			return nil, fmt.Errorf("count ready messages: %w", err)
		}
		info, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
		_ = ch.Close()
		if err != nil {
			return nil, fmt.Errorf("count ready messages of %s: %w", q, err)
		}
		out[q] = info.Messages
	}
	return out, nil
}
