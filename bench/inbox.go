package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"

	"github.com/outbox-inbox/reference/pkg/inbox"
)

// shipmentEvent is the document the shipping service writes per applied
// event (services/shipping/internal/mongodb): _id "order id/version".
type shipmentEvent struct {
	ID        string    `bson:"_id"`
	OrderID   string    `bson:"order_id"`
	Version   int64     `bson:"version"`
	MessageID string    `bson:"message_id"`
	EventType string    `bson:"event_type"`
	AppliedAt time.Time `bson:"applied_at"`
	Created   bson.M    `bson:"created,omitempty"`
}

// inboxMessage is one delivery of the workload.
type inboxMessage struct {
	id  string
	doc shipmentEvent
}

// inboxWorkload returns n deliveries of which dupShare are redeliveries of an
// earlier message: each duplicate arrives a little after its original (up to
// 200 deliveries later), as redeliveries do, sometimes while the original is
// still being processed.
func inboxWorkload(n int, dupShare float64, rng *rand.Rand) []inboxMessage {
	originals := n - int(float64(n)*dupShare)
	type keyed struct {
		key float64
		m   inboxMessage
	}
	all := make([]keyed, 0, n)
	msgs := make([]inboxMessage, originals)
	now := time.Now().UTC()
	for i := range originals {
		orderID := newUUID()
		id := strconv.Itoa(1_000_000 + i)
		msgs[i] = inboxMessage{id: id, doc: shipmentEvent{
			ID: orderID + "/1", OrderID: orderID, Version: 1, MessageID: id, EventType: eventCreated, AppliedAt: now,
			Created: bson.M{"customer_id": "c-" + strconv.Itoa(i%1000), "currency": "EUR", "total": int64(2500),
				"items": bson.A{bson.M{"sku": "sku-1", "quantity": int64(2), "unit_price": int64(1250)}}},
		}}
		all = append(all, keyed{float64(i), msgs[i]})
	}
	for range n - originals {
		i := rng.IntN(originals)
		all = append(all, keyed{float64(i) + 0.5 + rng.Float64()*200, msgs[i]})
	}
	slices.SortStableFunc(all, func(a, b keyed) int {
		switch {
		case a.key < b.key:
			return -1
		case a.key > b.key:
			return 1
		}
		return 0
	})
	out := make([]inboxMessage, len(all))
	for i, k := range all {
		out[i] = k.m
	}
	return out
}

// process runs msgs through fn with clients concurrent workers and returns
// the elapsed time.
func process(ctx context.Context, msgs []inboxMessage, clients int, fn func(context.Context, inboxMessage) error) (time.Duration, error) {
	ch := make(chan inboxMessage)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var first error
	start := time.Now()
	for range clients {
		wg.Go(func() {
			for m := range ch {
				if err := fn(ctx, m); err != nil {
					mu.Lock()
					first = cmp.Or(first, err)
					mu.Unlock()
				}
			}
		})
	}
	for _, m := range msgs {
		select {
		case ch <- m:
		case <-ctx.Done():
		}
		if ctx.Err() != nil {
			break
		}
	}
	close(ch)
	wg.Wait()
	if first == nil {
		first = ctx.Err()
	}
	return time.Since(start), first
}

// applyShipment is the shipping service's effect for a version 1 event:
// insert the event's document; a duplicate key is the same message applied
// before (checked by reading it), which makes the effect idempotent.
func applyShipment(ctx context.Context, coll *mongo.Collection, doc shipmentEvent) error {
	_, err := coll.InsertOne(ctx, doc)
	if err == nil || !mongo.IsDuplicateKeyError(err) {
		return err
	}
	var existing shipmentEvent
	if err := coll.FindOne(ctx, bson.D{{Key: "_id", Value: doc.ID}}).Decode(&existing); err != nil {
		return err
	}
	if existing.MessageID != doc.MessageID {
		return fmt.Errorf("version conflict on %s", doc.ID)
	}
	return nil
}

// runInboxThroughput measures inbox_throughput: deliveries per second through
// pkg/inbox (check, effect, record) with 20% duplicates, against a plain
// insert of the same documents, on the same embedded FerretDB with the same
// number of concurrent clients.
func (b *bench) runInboxThroughput(ctx context.Context) ([]Figure, error) {
	db, _, err := b.env.newMongoDatabase(ctx, "inbox", 100)
	if err != nil {
		return nil, err
	}
	const dupShare = 0.2
	n, clients := b.cfg.inboxMessages, b.cfg.inboxClients
	rng := rand.New(rand.NewPCG(42, uint64(n)))

	// The shipping service's inbox configuration (services/shipping/internal/app):
	// records buffered and flushed every 10ms, the default done cache.
	inboxCfg := inbox.Config{Consumer: "bench", Standalone: inbox.StandaloneConfig{FlushInterval: 10 * time.Millisecond}}

	var plainRates, inboxRates []float64
	var processed, duplicates, plainDup atomic.Int64
	for rep := range b.cfg.reps {
		msgs := inboxWorkload(n, dupShare, rng)

		// Baseline: insert every delivery's document; a duplicate's insert
		// fails on the unique _id and is ignored.
		plain := db.Collection("plain_" + strconv.Itoa(rep))
		d, err := process(ctx, msgs, clients, func(ctx context.Context, m inboxMessage) error {
			_, err := plain.InsertOne(ctx, m.doc)
			if mongo.IsDuplicateKeyError(err) {
				plainDup.Add(1)
				return nil
			}
			return err
		})
		if err != nil {
			return nil, fmt.Errorf("plain insert: %w", err)
		}
		plainRates = append(plainRates, rate(n, d))

		// Inbox: what the shipping service does per delivery.
		cfg := inboxCfg
		cfg.Collection = "inbox_" + strconv.Itoa(rep)
		in, err := inbox.New(db, cfg)
		if err != nil {
			return nil, err
		}
		if err := in.EnsureIndexes(ctx); err != nil {
			return nil, err
		}
		effects := db.Collection("shipment_events_" + strconv.Itoa(rep))
		d, err = process(ctx, msgs, clients, func(ctx context.Context, m inboxMessage) error {
			res, err := in.Process(ctx, m.id, func(ctx context.Context) error {
				return applyShipment(ctx, effects, m.doc)
			})
			switch {
			case err != nil:
				return err
			case res == inbox.Duplicate:
				duplicates.Add(1)
			default:
				processed.Add(1)
			}
			return nil
		})
		// Close writes the records still buffered (as the service does at
		// shutdown); it is not part of the measured time.
		if cerr := in.Close(ctx); err == nil && cerr != nil {
			err = cerr
		}
		if err != nil {
			return nil, fmt.Errorf("inbox: %w", err)
		}
		inboxRates = append(inboxRates, rate(n, d))

		// Both must end with one document per distinct message.
		want := int64(n - int(float64(n)*dupShare))
		for _, c := range []*mongo.Collection{plain, effects, in.Collection()} {
			got, err := c.CountDocuments(ctx, bson.D{})
			if err != nil {
				return nil, err
			}
			if got != want {
				return nil, fmt.Errorf("%s holds %d documents, want %d", c.Name(), got, want)
			}
		}
		b.log.Info("inbox_throughput", "rep", rep, "plain_per_s", int(plainRates[rep]), "inbox_per_s", int(inboxRates[rep]))
	}
	lookups, err := measureLookups(ctx, db, []int{1000, 5000}, 5)
	if err != nil {
		return nil, fmt.Errorf("lookup diagnostic: %w", err)
	}
	mode, err := (func() (inbox.Mode, error) {
		in, err := inbox.New(db, inbox.Config{Consumer: "bench"})
		if err != nil {
			return "", err
		}
		return in.Mode(ctx)
	})()
	if err != nil {
		return nil, errors.Join(errors.New("inbox mode"), err)
	}
	details := map[string]any{
		"messages": n, "duplicate_share": dupShare, "clients": clients, "repetitions": b.cfg.reps,
		"inbox_mode": string(mode), "plain_per_s": plainRates, "inbox_per_s": inboxRates,
		"inbox_processed": processed.Load(), "inbox_duplicates": duplicates.Load(), "plain_duplicate_key_errors": plainDup.Load(),
		"inbox_flush_interval_ms": ms(inboxCfg.Standalone.FlushInterval), "inbox_flush_batch": inbox.DefaultFlushBatch, "inbox_done_cache_size": inbox.DefaultDoneCacheSize,
		"find_by_id_miss_ms": lookups,
	}
	return []Figure{newFigure("inbox_throughput", "messages/s", median(inboxRates), median(plainRates), Goal{RatioAtLeast, 0.5},
		fmt.Sprintf("deliveries/s through pkg/inbox as the shipping service configures it (%s mode: done cache of 10000 ids, check, the shipping effect, record buffered and written in bulk every %v) with %.0f%% duplicates, %d messages, %d concurrent clients, embedded FerretDB (median of %d runs)",
			mode, inboxCfg.Standalone.FlushInterval, dupShare*100, n, clients, b.cfg.reps),
		"plain InsertOne of the same documents (duplicates fail on the unique _id), same server, same concurrency", details)}, nil
}

// measureLookups times what Inbox.IsDone does for a new message, a FindOne by
// _id that finds nothing, on collections of the given sizes, with the
// inbox's document _id ({consumer, message_id}) and with a string _id. On
// FerretDB's SQLite backend neither uses the _id index, so the time grows
// with the collection; the string one is filtered inside SQLite, the
// document one in FerretDB.
func measureLookups(ctx context.Context, db *mongo.Database, sizes []int, probes int) (map[string]float64, error) {
	docColl, strColl := db.Collection("lookup_document_id"), db.Collection("lookup_string_id")
	out := map[string]float64{}
	have := 0
	for _, size := range sizes {
		var docs, strs []any
		for ; have < size; have++ {
			id := strconv.Itoa(have)
			docs = append(docs, bson.D{{Key: "_id", Value: bson.D{{Key: "consumer", Value: "shipping"}, {Key: "message_id", Value: id}}}, {Key: "state", Value: "done"}})
			strs = append(strs, bson.D{{Key: "_id", Value: "shipping/" + id}, {Key: "state", Value: "done"}})
		}
		if len(docs) > 0 {
			if _, err := docColl.InsertMany(ctx, docs); err != nil {
				return nil, err
			}
			if _, err := strColl.InsertMany(ctx, strs); err != nil {
				return nil, err
			}
		}
		for _, c := range []struct {
			name   string
			coll   *mongo.Collection
			filter func(i int) bson.D
		}{
			{"document_id", docColl, func(i int) bson.D {
				return bson.D{{Key: "_id", Value: bson.D{{Key: "consumer", Value: "shipping"}, {Key: "message_id", Value: "new-" + strconv.Itoa(i)}}}}
			}},
			{"string_id", strColl, func(i int) bson.D { return bson.D{{Key: "_id", Value: "shipping/new-" + strconv.Itoa(i)}} }},
		} {
			start := time.Now()
			for i := range probes {
				if err := c.coll.FindOne(ctx, c.filter(i)).Err(); !errors.Is(err, mongo.ErrNoDocuments) {
					return nil, fmt.Errorf("probe %s: %v", c.name, err)
				}
			}
			out[fmt.Sprintf("%s_at_%d_docs", c.name, size)] = ms(time.Since(start) / time.Duration(probes))
		}
	}
	return out, nil
}
