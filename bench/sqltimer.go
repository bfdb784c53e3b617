package main

import (
	"context"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// sqlTimer is a pgx tracer that times the statements the relay sends, by
// kind, so the benchmark measures the relay's own SQL as the relay runs it
// (the claim is recognised by outbox.StatementOf).
type sqlTimer struct {
	mu        sync.Mutex
	enabled   bool
	byKind    map[string][]time.Duration
	claimSQL  string
	claimArgs []any
}

var (
	_ pgx.QueryTracer = (*sqlTimer)(nil)
	_ pgx.BatchTracer = (*sqlTimer)(nil)
)

func newSQLTimer() *sqlTimer { return &sqlTimer{byKind: map[string][]time.Duration{}} }

type timerKey struct{}

type timerStart struct {
	kind string
	at   time.Time
}

// claimKind recognises the polling relay's claim.
func claimKind(sql string) string {
	if outbox.StatementOf(sql) == outbox.StatementClaim {
		return "claim"
	}
	return ""
}

func (t *sqlTimer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	kind := claimKind(d.SQL)
	if kind == "" {
		return ctx
	}
	t.mu.Lock()
	if t.claimSQL == "" {
		t.claimSQL, t.claimArgs = d.SQL, d.Args
	}
	t.mu.Unlock()
	return context.WithValue(ctx, timerKey{}, timerStart{kind, time.Now()})
}

func (t *sqlTimer) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryEndData) {
	if s, ok := ctx.Value(timerKey{}).(timerStart); ok && s.kind == "claim" && d.Err == nil && d.CommandTag.RowsAffected() == 0 {
		// A claim that found nothing due: the wake-up and poll case.
		ctx = context.WithValue(ctx, timerKey{}, timerStart{"claim_empty", s.at})
	}
	t.end(ctx, d.Err)
}

func (t *sqlTimer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return context.WithValue(ctx, timerKey{}, timerStart{"batch", time.Now()})
}

func (t *sqlTimer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (t *sqlTimer) TraceBatchEnd(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchEndData) {
	t.end(ctx, d.Err)
}

func (t *sqlTimer) end(ctx context.Context, err error) {
	s, ok := ctx.Value(timerKey{}).(timerStart)
	if !ok || err != nil {
		return
	}
	d := time.Since(s.at)
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.enabled {
		t.byKind[s.kind] = append(t.byKind[s.kind], d)
	}
}

// start discards what was recorded and records from now on.
func (t *sqlTimer) start() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.byKind = map[string][]time.Duration{}
	t.enabled = true
}

// stop ends recording and returns the durations recorded, by kind.
func (t *sqlTimer) stop() map[string][]time.Duration {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.enabled = false
	out := t.byKind
	t.byKind = map[string][]time.Duration{}
	return out
}

// claimStatement returns the first claim seen, "" if none.
func (t *sqlTimer) claimStatement() (string, []any) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.claimSQL, t.claimArgs
}
