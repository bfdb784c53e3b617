package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"

	"github.com/outbox-inbox/reference/e2e/chaos"
)

// Where shipping keeps what the effects audit reads
// (services/shipping/internal/mongodb, pkg/inbox, services/shipping/internal/app).
const (
	// effectLogCollection is shipping's effect log: one entry per run of a
	// message's effect (mongodb.EffectLogCollection).
	effectLogCollection = "shipment_effect_log"
	// inboxCollection holds pkg/inbox's records (inbox.Config.Collection's
	// default, which shipping keeps); shipping's records' _id is
	// "shipping/<message id>".
	inboxCollection = "inbox"
	inboxConsumer   = "shipping"
	// writerLogKey is the attribute of shipping's start line naming the
	// identity it writes effect-log entries under.
	writerLogKey = "effect_log_writer"
	// inboxRecordWindow bounds how long after its effect shipping's done
	// record may still be unwritten with no fault: records are buffered for
	// INBOX_FLUSH_INTERVAL (10ms by default) and written by one bulk
	// insert, retried after at most a second's pause when it fails; the
	// rest is room for a loaded machine (runs on two busy cores saw second
	// runs 1.0 to 1.2 s after the first entry with no fault to explain
	// them, and a record not written 1 s after a MongoDB fault).
	inboxRecordWindow = 3 * time.Second
)

// readEffectsAudit reads shipping's effect log, inbox records and every
// shipment document (no-ops and discards included), and the process runs
// that wrote the log, from the shipping processes' logs.
func (c *cluster) readEffectsAudit(ctx context.Context, dupes *duplicateScraper) (*chaos.EffectsAudit, error) {
	client, err := mongo.Connect(options.Client().ApplyURI("mongodb://" + c.mongo.addr() + "/" + c.mongo.uriQuery()).
		SetServerSelectionTimeout(30 * time.Second))
	if err != nil {
		return nil, fmt.Errorf("read the effects audit: %w", err)
	}
	defer func() { _ = client.Disconnect(context.WithoutCancel(ctx)) }()
	db := client.Database(c.id)
	a := &chaos.EffectsAudit{DuplicatesByLayer: dupes.byLayer()}

	var log []struct {
		MessageID string    `bson:"message_id"`
		OrderID   string    `bson:"order_id"`
		Version   int64     `bson:"version"`
		EventType string    `bson:"event_type"`
		StartedAt time.Time `bson:"started_at"`
		At        time.Time `bson:"at"`
		Writer    string    `bson:"writer"`
	}
	if err := findAll(ctx, db.Collection(effectLogCollection), &log); err != nil {
		return nil, err
	}
	for _, e := range log {
		a.Witness = append(a.Witness, chaos.WitnessEntry{MessageID: e.MessageID, OrderID: e.OrderID, Version: e.Version,
			EventType: e.EventType, Started: e.StartedAt, At: e.At, Writer: e.Writer})
	}
	var recs []struct {
		Consumer    string    `bson:"consumer"`
		MessageID   string    `bson:"message_id"`
		State       string    `bson:"state"`
		ProcessedAt time.Time `bson:"processed_at"`
	}
	if err := findAll(ctx, db.Collection(inboxCollection), &recs); err != nil {
		return nil, err
	}
	for _, r := range recs {
		if r.Consumer == inboxConsumer {
			a.Inbox = append(a.Inbox, chaos.InboxRecord{MessageID: r.MessageID, State: r.State, ProcessedAt: r.ProcessedAt})
		}
	}
	var docs []shipmentRecord
	if err := findAll(ctx, db.Collection(shipmentsCollection), &docs); err != nil {
		return nil, err
	}
	for _, d := range docs {
		a.Effects = append(a.Effects, chaos.StoredEffect{MessageID: d.MessageID, OrderID: d.OrderID, Version: d.Version,
			EventType: d.EventType, Discarded: d.Discarded})
	}
	for _, p := range c.shipping {
		ws, fs, err := logWriters(p.spec.name, p.log.Name())
		if err != nil {
			return nil, err
		}
		a.Writers = append(a.Writers, ws...)
		a.Failures = append(a.Failures, fs...)
	}
	return a, nil
}

func findAll(ctx context.Context, coll *mongo.Collection, out any) error {
	cur, err := coll.Find(ctx, bson.D{})
	if err != nil {
		return fmt.Errorf("read %s: %w", coll.Name(), err)
	}
	if err := cur.All(ctx, out); err != nil {
		return fmt.Errorf("read %s: %w", coll.Name(), err)
	}
	return nil
}

var (
	// The supervisor's lines in a process's log (proc.startLocked, proc.watch).
	startLine = regexp.MustCompile(`^=== chaos: (\S+) start #(\d+) at `)
	exitLine  = regexp.MustCompile(`^=== chaos: (\S+) #(\d+) exited: (.*) at (\S+)$`)
)

// failedRunLogs are shipping's log messages for a run that failed after the
// inbox's check: the inbox recorded nothing, the message comes back
// (services/shipping/internal/processor).
var failedRunLogs = []string{
	"inbox failed, deferring the message",
	"transient inbox failure, deferring the message",
	"MongoDB unavailable, keeping the delivery until it is back",
	"handler failed",
}

// logWriters reads, from a shipping process's log, each of its runs that
// logged an effect-log writer (which run it was, when it exited and whether
// it was SIGKILLed) and the failed runs each logged.
func logWriters(name, path string) ([]chaos.Writer, []chaos.RunFailure, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, fmt.Errorf("read %s's log: %w", name, err)
	}
	defer f.Close()
	var (
		out      []chaos.Writer
		failures []chaos.RunFailure
		cur      = -1 // index in out of the running incarnation's writer
		inc      int
	)
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64<<10), 4<<20)
	for sc.Scan() {
		line := sc.Text()
		if m := startLine.FindStringSubmatch(line); m != nil && m[1] == name {
			inc, _ = strconv.Atoi(m[2])
			cur = -1
			continue
		}
		if m := exitLine.FindStringSubmatch(line); m != nil && m[1] == name {
			n, _ := strconv.Atoi(m[2])
			at, err := time.Parse(time.RFC3339Nano, m[4])
			if err != nil {
				return nil, nil, fmt.Errorf("%s's log: exit line %q: %w", name, line, err)
			}
			for i := range out {
				if out[i].Incarnation == n {
					out[i].Exited, out[i].Killed = at, strings.Contains(m[3], "killed")
				}
			}
			continue
		}
		if cur >= 0 {
			if fl, ok := failedRun(line); ok {
				fl.Writer = out[cur].ID
				failures = append(failures, fl)
			}
			continue
		}
		if !strings.Contains(line, writerLogKey) {
			continue
		}
		var l map[string]any
		if json.Unmarshal([]byte(line), &l) != nil {
			continue
		}
		if id, ok := l[writerLogKey].(string); ok && id != "" {
			out = append(out, chaos.Writer{ID: id, Proc: name, Incarnation: inc})
			cur = len(out) - 1
		}
	}
	if err := sc.Err(); err != nil {
		return nil, nil, fmt.Errorf("read %s's log: %w", name, err)
	}
	return out, failures, nil
}

// failedRun parses a log line of a failed run (failedRunLogs), without the
// writer.
func failedRun(line string) (chaos.RunFailure, bool) {
	if !strings.Contains(line, `"event_id"`) ||
		!slices.ContainsFunc(failedRunLogs, func(m string) bool { return strings.Contains(line, m) }) {
		return chaos.RunFailure{}, false
	}
	var l struct {
		Time    time.Time `json:"time"`
		Msg     string    `json:"msg"`
		EventID string    `json:"event_id"`
	}
	if json.Unmarshal([]byte(line), &l) != nil || l.EventID == "" || !slices.Contains(failedRunLogs, l.Msg) {
		return chaos.RunFailure{}, false
	}
	return chaos.RunFailure{MessageID: l.EventID, At: l.Time, Msg: l.Msg}, true
}

// scrapeCounterBy returns a Prometheus counter's samples by the value of
// one label, from a text exposition.
func scrapeCounterBy(exposition, name, label string) map[string]float64 {
	out := make(map[string]float64)
	for line := range strings.SplitSeq(exposition, "\n") {
		rest, ok := strings.CutPrefix(line, name+"{")
		if !ok {
			continue
		}
		labels, value, ok := strings.Cut(rest, "}")
		if !ok {
			continue
		}
		f := strings.Fields(value)
		if len(f) == 0 {
			continue
		}
		v, err := strconv.ParseFloat(f[0], 64)
		if err != nil {
			continue
		}
		for kv := range strings.SplitSeq(labels, ",") {
			if k, val, ok := strings.Cut(kv, "="); ok && k == label {
				out[strings.Trim(val, `"`)] += v
			}
		}
	}
	return out
}
