package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
)

// listen wakes the relay on every notification on the configured channel. It
// holds one connection of its own, opened from the pool's configuration but
// outside the pool, and reopens it with backoff when it breaks; every
// (re)connection wakes the relay too, since notifications sent while it was
// down are lost. The backoff starts over once a LISTEN succeeded, so a
// connection that breaks now and then is reopened at once each time.
func (r *Relay) listen(ctx context.Context) {
	stmt := "LISTEN " + pgx.Identifier{r.cfg.NotifyChannel}.Sanitize()
	var failures int
	for ctx.Err() == nil {
		listened, err := r.listenOnce(ctx, stmt)
		if ctx.Err() != nil {
			return
		}
		if listened {
			failures = 0
		}
		failures++
		r.cfg.Metrics.ListenReconnected()
		wait := jitter(backoff(failures, 100*time.Millisecond, 10*time.Second))
		r.log.WarnContext(ctx, "outbox relay: LISTEN connection lost, reconnecting",
			slog.String("notify_channel", r.cfg.NotifyChannel), slog.Any("error", err), slog.Duration("retry_in", wait))
		sleep(ctx, wait)
	}
}

// listenOnce connects, listens and wakes the relay on each notification until
// the connection fails. It reports whether the LISTEN succeeded.
//
// A connection can also die silently (a partition, a firewall that drops idle
// flows): no error ever comes, and WaitForNotification would wait forever. So
// when nothing arrived for ListenKeepalive, it pings, and a ping that does not
// come back within ListenKeepalive ends the connection. The connection uses a
// deadline to interrupt a wait, which leaves it usable; see pgconn's
// DeadlineContextWatcherHandler.
func (r *Relay) listenOnce(ctx context.Context, stmt string) (listened bool, err error) {
	cfg := r.pool.Config().ConnConfig.Copy()
	cfg.BuildContextWatcherHandler = func(c *pgconn.PgConn) ctxwatch.Handler {
		return &pgconn.DeadlineContextWatcherHandler{Conn: c.Conn()}
	}
	dctx, cancel := context.WithTimeout(ctx, max(r.cfg.ListenKeepalive, 10*time.Second))
	conn, err := pgx.ConnectConfig(dctx, cfg)
	cancel()
	if err != nil {
		return false, fmt.Errorf("connect: %w", err)
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		defer cancel()
		_ = conn.Close(cctx)
	}()
	lctx, cancel := context.WithTimeout(ctx, max(r.cfg.ListenKeepalive, 10*time.Second))
	_, err = conn.Exec(lctx, stmt)
	cancel()
	if err != nil {
		return false, fmt.Errorf("listen: %w", err)
	}
	r.Wake()
	for {
		wctx, cancel := context.WithTimeout(ctx, r.cfg.ListenKeepalive)
		_, err := conn.WaitForNotification(wctx)
		cancel()
		switch {
		case err == nil:
			r.Wake()
			continue
		case ctx.Err() != nil:
			return true, ctx.Err()
		case !errors.Is(err, context.DeadlineExceeded):
			return true, fmt.Errorf("wait for notification: %w", err)
		}
		pctx, cancel := context.WithTimeout(ctx, r.cfg.ListenKeepalive)
		err = conn.Ping(pctx)
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				return true, ctx.Err()
			}
			return true, fmt.Errorf("keepalive ping: no answer within %v: %w", r.cfg.ListenKeepalive, err)
		}
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
