package outbox

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"

	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxsql"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/retry"
)

// errNoNotifications is the probe's verdict on a LISTEN connection that
// notifications do not reach.
var errNoNotifications = errors.New("the notification the relay sent itself did not arrive")

// errProbeNotSent is the probe's failure to send its notification through
// the pool.
var errProbeNotSent = errors.New("listen probe: send a notification")

// listen wakes the relay on every notification on the configured channel. It
// holds one connection of its own, outside the pool (from ListenConfig, or the
// pool's configuration), and reopens it with backoff when it breaks; every
// (re)connection wakes the relay too, since notifications sent while it was
// down are lost. The backoff starts over once a LISTEN succeeded, so a
// connection that breaks now and then is reopened at once each time.
//
// Each connection is first probed (see RelayConfig.ListenProbeTimeout): when
// the relay's own notification does not come back, as behind a
// transaction-pooling PgBouncer, the relay falls back on its poll and tries
// again ListenProbeRetry later.
func (r *Relay) listen(ctx context.Context) {
	stmt := "LISTEN " + pgx.Identifier{r.cfg.NotifyChannel}.Sanitize()
	var failures int
	for ctx.Err() == nil {
		listened, err := r.listenOnce(ctx, stmt)
		if ctx.Err() != nil {
			return
		}
		if errors.Is(err, errNoNotifications) {
			failures = 0
			observe(ctx, r.cfg.Observer, Observation{Kind: KindListenFallback, Fallback: true})
			r.log.WarnContext(ctx, "outbox relay: notifications do not arrive on the LISTEN connection, falling back to polling; "+
				"behind a transaction-pooling PgBouncer, give the relay a direct connection for LISTEN",
				slog.String("notify_channel", r.cfg.NotifyChannel), slog.Any("error", err),
				slog.Duration("poll_interval", r.cfg.PollInterval), slog.Duration("retry_in", r.cfg.ListenProbeRetry))
			retry.Sleep(ctx, r.cfg.ListenProbeRetry)
			continue
		}
		if listened {
			failures = 0
		}
		failures++
		observe(ctx, r.cfg.Observer, Observation{Kind: KindListenReconnected})
		wait := retry.Jitter(retry.Backoff(failures, 100*time.Millisecond, 10*time.Second))
		r.log.WarnContext(ctx, "outbox relay: LISTEN connection lost, reconnecting",
			slog.String("notify_channel", r.cfg.NotifyChannel), slog.Any("error", err), slog.Duration("retry_in", wait))
		retry.Sleep(ctx, wait)
	}
}

// listenOnce connects, listens and wakes the relay on each notification until
// the connection fails. It reports whether the LISTEN succeeded (and its
// probe could send its notification).
//
// A connection can also die silently (a partition, a firewall that drops idle
// flows): no error ever comes, and WaitForNotification would wait forever. So
// when nothing arrived for ListenKeepalive, it pings, and a ping that does not
// come back within ListenKeepalive ends the connection. The connection uses a
// deadline to interrupt a wait, which leaves it usable; see pgconn's
// DeadlineContextWatcherHandler.
func (r *Relay) listenOnce(ctx context.Context, stmt string) (listened bool, err error) {
	var cfg *pgx.ConnConfig
	if r.cfg.ListenConfig != nil {
		cfg = r.cfg.ListenConfig.Copy()
	} else {
		cfg = r.pool.Config().ConnConfig.Copy()
	}
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
	if r.cfg.ListenProbeTimeout > 0 {
		if err := r.probe(ctx, conn); err != nil {
			// A probe that could not even send (the pool down while the
			// direct LISTEN URL answers) is no LISTEN that worked: it must
			// not reset the backoff, or the relay reconnects every 100ms.
			return !errors.Is(err, errProbeNotSent), err
		}
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

// probe sends a notification on the channel through the pool, as writers do,
// and waits up to ListenProbeTimeout for it on conn, which LISTENs. Other
// notifications that come meanwhile wake the relay. It returns
// errNoNotifications when its own did not come in time although conn still
// answers a ping.
func (r *Relay) probe(ctx context.Context, conn *pgx.Conn) error {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	payload := "outbox-listen-probe-" + hex.EncodeToString(b)
	pctx, cancel := context.WithTimeout(ctx, r.cfg.ListenProbeTimeout)
	defer cancel()
	if _, err := r.pool.Exec(pctx, "SELECT pg_notify($1, $2)", r.cfg.NotifyChannel, payload); err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return fmt.Errorf("%w: %w", errProbeNotSent, err)
	}
	for {
		n, err := conn.WaitForNotification(pctx)
		switch {
		case err == nil && n.Payload == payload:
			observe(ctx, r.cfg.Observer, Observation{Kind: KindListenFallback, Fallback: false})
			return nil
		case err == nil:
			r.Wake()
		case ctx.Err() != nil:
			return ctx.Err()
		case errors.Is(err, context.DeadlineExceeded):
			// A connection that died silently during the probe delivers
			// nothing either: reconnect rather than fall back.
			kctx, cancel := context.WithTimeout(ctx, r.cfg.ListenKeepalive)
			err := conn.Ping(kctx)
			cancel()
			if err != nil {
				if ctx.Err() != nil {
					return ctx.Err()
				}
				return fmt.Errorf("listen probe: keepalive ping: no answer within %v: %w", r.cfg.ListenKeepalive, err)
			}
			return fmt.Errorf("%w within %v", errNoNotifications, r.cfg.ListenProbeTimeout)
		default:
			return fmt.Errorf("listen probe: wait for notification: %w", err)
		}
	}
}

// purge deletes old published rows every PurgeInterval.
func (r *Relay) purge(ctx context.Context) {
	t := time.NewTicker(r.cfg.PurgeInterval)
	defer t.Stop()
	for {
		n, err := outboxsql.Purge(ctx, r.pool, r.cfg.PublishedRetention, r.cfg.PurgeBatchSize)
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
