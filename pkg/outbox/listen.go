package outbox

import (
	"context"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
)

// listen wakes the relay on every notification on the configured channel. It
// holds one connection of its own, opened from the pool's configuration but
// outside the pool, and reopens it with backoff when it breaks; every
// (re)connection wakes the relay too, since notifications sent while it was
// down are lost.
func (r *Relay) listen(ctx context.Context) {
	stmt := "LISTEN " + pgx.Identifier{r.cfg.NotifyChannel}.Sanitize()
	var failures int
	for ctx.Err() == nil {
		err := r.listenOnce(ctx, stmt)
		if ctx.Err() != nil {
			return
		}
		failures++
		wait := jitter(backoff(failures, 100*time.Millisecond, 10*time.Second))
		r.log.WarnContext(ctx, "outbox relay: LISTEN connection lost, reconnecting",
			slog.String("notify_channel", r.cfg.NotifyChannel), slog.Any("error", err), slog.Duration("retry_in", wait))
		sleep(ctx, wait)
	}
}

func (r *Relay) listenOnce(ctx context.Context, stmt string) error {
	conn, err := pgx.ConnectConfig(ctx, r.pool.Config().ConnConfig)
	if err != nil {
		return err
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		defer cancel()
		_ = conn.Close(cctx)
	}()
	if _, err := conn.Exec(ctx, stmt); err != nil {
		return err
	}
	r.Wake()
	for {
		if _, err := conn.WaitForNotification(ctx); err != nil {
			return err
		}
		r.Wake()
	}
}

// purge deletes old published rows every PurgeInterval.
func (r *Relay) purge(ctx context.Context) {
	t := time.NewTicker(r.cfg.PurgeInterval)
	defer t.Stop()
	for {
		n, err := r.admin.Purge(ctx, r.cfg.PublishedRetention, r.cfg.PurgeBatchSize)
		switch {
		case ctx.Err() != nil:
			return
		case err != nil:
			r.log.ErrorContext(ctx, "outbox relay: purge failed", slog.Any("error", err))
		case n > 0:
			r.log.InfoContext(ctx, "outbox relay: purged published rows", slog.Int64("rows", n))
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
