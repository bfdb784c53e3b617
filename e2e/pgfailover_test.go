package e2e

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"

	"github.com/outbox-inbox/reference/e2e/chaos"
)

// proxyPostgres is the proxy between every client of the run's database
// (services and harness) and the run's own PostgreSQL: a failover switches
// it to the promoted standby, as a DNS name or a virtual IP would in
// production.
const proxyPostgres = chaos.TargetPostgres

// putPostgresBehindProxy makes the run's database URL go through
// proxyPostgres, and registers the removal of every standby the faults leave.
func (c *cluster) putPostgresBehindProxy() error {
	addr, err := c.toxi.add(proxyPostgres, c.pg.addr())
	if err != nil {
		return err
	}
	c.dbURL = "postgres://postgres@" + addr + "/" + c.id + "?sslmode=disable"
	c.t.Cleanup(func() {
		for _, st := range c.standbys {
			if err := st.close(); err != nil {
				c.t.Errorf("cleanup: PostgreSQL standby: %v", err)
			}
		}
	})
	return nil
}

// relayDatabaseURL is the relays' DATABASE_URL: the run's database, their
// commits local (synchronous_commit=local), as docs/wal-relay.md recommends
// under synchronous replication. What a relay records (marks, sweeps, the
// dispatched position) is redone if a failover loses it, so it need not wait
// for a standby; and a relay that waited could not publish during
// postgres_sync_stall, which would hide the phantom that fault looks for.
func (c *cluster) relayDatabaseURL() string {
	u, err := url.Parse(c.dbURL)
	if err != nil {
		return "DATABASE_URL=" + c.dbURL
	}
	q := u.Query()
	q.Set("synchronous_commit", "local")
	u.RawQuery = q.Encode()
	return "DATABASE_URL=" + u.String()
}

func (pg *ownPostgres) addr() string { return net.JoinHostPort("127.0.0.1", pg.port) }

// newStandby makes a streaming standby of the run's primary with
// pg_basebackup (as the postgres user, in a data directory and on a port of
// its own), named name for synchronous_standby_names, starts it and waits
// until the primary streams to it. With stream set, the standby streams
// through a proxy of that name, which a fault can cut.
func (c *cluster) newStandby(ctx context.Context, name, stream string) (*ownPostgres, error) {
	primary := c.pg
	upstream := primary.port
	if stream != "" {
		addr, err := c.toxi.add(stream, primary.addr())
		if err != nil {
			return nil, err
		}
		if _, upstream, err = net.SplitHostPort(addr); err != nil {
			return nil, err
		}
	}
	dir, err := os.MkdirTemp("", "chaos-pg-standby-")
	if err != nil {
		return nil, fmt.Errorf("standby: %w", err)
	}
	st := &ownPostgres{dir: dir, bin: primary.bin, cred: primary.cred}
	c.standbys = append(c.standbys, st)
	if primary.cred != nil {
		if err := os.Chown(dir, int(primary.cred.Uid), int(primary.cred.Gid)); err != nil {
			return nil, fmt.Errorf("standby: %w", err)
		}
	}
	data := filepath.Join(dir, "data")
	conninfo := fmt.Sprintf("host=127.0.0.1 port=%s user=postgres application_name=%s", upstream, name)
	backup := exec.CommandContext(ctx, filepath.Join(primary.bin, "pg_basebackup"),
		"-d", conninfo, "-D", data, "-R", "-X", "stream", "-c", "fast", "--no-sync")
	backup.SysProcAttr = &syscall.SysProcAttr{Credential: primary.cred}
	backup.Dir = dir
	if out, err := backup.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("standby: pg_basebackup: %w\n%s", err, out)
	}
	// -R wrote a primary_conninfo without the application_name the
	// synchronous_standby_names setting matches: a later line wins.
	conf, err := os.OpenFile(filepath.Join(data, "postgresql.auto.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return nil, fmt.Errorf("standby: %w", err)
	}
	_, werr := fmt.Fprintf(conf, "primary_conninfo = '%s'\n", conninfo)
	if err := errors.Join(werr, conf.Close()); err != nil {
		return nil, fmt.Errorf("standby: %w", err)
	}
	if st.port, err = freePort(); err != nil {
		return nil, err
	}
	c.pgNodes++
	st.p, err = newProc(procSpec{
		name: "postgres-" + strconv.Itoa(c.pgNodes), bin: filepath.Join(primary.bin, "postgres"),
		args: ownPostgresArgs(data, st.port, dir), cred: primary.cred, stopSignal: syscall.SIGINT,
	}, c.runDir, c.onExit)
	if err != nil {
		return nil, err
	}
	if err := st.start(ctx); err != nil {
		return nil, err
	}
	err = pollPostgres(ctx, primary.url("postgres"), time.Minute, func(conn *pgx.Conn) (bool, error) {
		var n int
		err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_stat_replication WHERE application_name = $1 AND state = 'streaming'`, name).Scan(&n)
		return n > 0, err
	})
	if err != nil {
		return nil, fmt.Errorf("standby %s not streaming: %w", name, err)
	}
	return st, nil
}

// pollPostgres runs cond on a connection to url every 100ms until it
// returns true, or timeout passes.
func pollPostgres(ctx context.Context, url string, timeout time.Duration, cond func(*pgx.Conn) (bool, error)) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var last error
	for {
		conn, err := pgx.Connect(ctx, url)
		if err == nil {
			var ok bool
			ok, err = cond(conn)
			_ = conn.Close(ctx)
			if err == nil && ok {
				return nil
			}
		}
		if err != nil {
			last = err
		}
		select {
		case <-ctx.Done():
			return errors.Join(ctx.Err(), last)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// promote makes st the run's primary: pg_promote on it, the proxies
// switched to it (the API's and each relay's). The old primary, stopped,
// keeps its data directory for readDeadPrimary; it is among the standbys the
// cleanup removes until then.
func (c *cluster) promote(ctx context.Context, st *ownPostgres) error {
	if err := st.start(ctx); err != nil {
		return err
	}
	conn, err := pgx.Connect(ctx, st.url("postgres"))
	if err != nil {
		return fmt.Errorf("promote: %w", err)
	}
	var promoted bool
	err = conn.QueryRow(ctx, `SELECT pg_promote(true, 60)`).Scan(&promoted)
	_ = conn.Close(ctx)
	if err != nil || !promoted {
		return fmt.Errorf("promote the standby on port %s: promoted=%v: %w", st.port, promoted, err)
	}
	for _, name := range c.postgresProxies() {
		if err := c.toxi.setUpstream(name, st.addr()); err != nil {
			return err
		}
	}
	c.pgMu.Lock()
	old := c.pg
	c.pg, c.adminURL = st, st.url("postgres")
	c.pgMu.Unlock()
	c.forgetStandby(st)
	c.standbys = append(c.standbys, old)
	return nil
}

// readDeadPrimary reads back what old, a primary a failover stopped
// immediately, held: its data directory started alone (crash recovery), as
// a primary without replication (no standby signal, no primary_conninfo),
// read-only, listening on a unix socket in its own directory and on no TCP
// port, so that no client of the run can reach it. The final state's readers
// (readOrders, readEvents) read it; then it is stopped and its directory
// removed.
func (c *cluster) readDeadPrimary(ctx context.Context, old *ownPostgres, cut, killed time.Time) (chaos.DeadPrimaryState, error) {
	d := chaos.DeadPrimaryState{StreamCut: cut, Killed: killed}
	defer func() {
		c.forgetStandby(old)
		if err := old.close(); err != nil {
			c.t.Errorf("remove the dead primary: %v", err)
		}
	}()
	data := filepath.Join(old.dir, "data")
	for _, signal := range []string{"standby.signal", "recovery.signal"} {
		if err := os.Remove(filepath.Join(data, signal)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return d, fmt.Errorf("dead primary: %w", err)
		}
	}
	c.pgNodes++
	p, err := newProc(procSpec{
		name: "postgres-dead-" + strconv.Itoa(c.pgNodes), bin: filepath.Join(old.bin, "postgres"),
		args: []string{"-D", data, "-p", old.port, "-k", old.dir, "-c", "listen_addresses=",
			"-c", "primary_conninfo=", "-c", "fsync=off", "-c", "wal_level=logical", "-c", "log_min_messages=warning",
			"-c", "default_transaction_read_only=on"},
		cred: old.cred, stopSignal: syscall.SIGINT,
	}, c.runDir, c.onExit)
	if err != nil {
		return d, fmt.Errorf("dead primary: %w", err)
	}
	defer func() {
		if err := p.close(); err != nil {
			c.t.Errorf("stop the dead primary: %v", err)
		}
	}()
	if _, err := p.start(); err != nil {
		return d, fmt.Errorf("dead primary: %w", err)
	}
	socket := func(db string) string {
		return "postgres://postgres@/" + db + "?" + url.Values{"host": {old.dir}, "port": {old.port}, "sslmode": {"disable"}}.Encode()
	}
	if err := pollPostgres(ctx, socket("postgres"), 2*time.Minute, func(*pgx.Conn) (bool, error) { return true, nil }); err != nil {
		return d, fmt.Errorf("dead primary in %s not accepting connections: %w", data, err)
	}
	db, err := pgxpool.New(ctx, socket(c.id))
	if err != nil {
		return d, fmt.Errorf("dead primary: %w", err)
	}
	defer db.Close()
	if d.Orders, err = readOrders(ctx, db); err != nil {
		return d, fmt.Errorf("dead primary: %w", err)
	}
	if d.Events, _, err = readEvents(ctx, db); err != nil {
		return d, fmt.Errorf("dead primary: %w", err)
	}
	return d, nil
}

// forgetStandby drops st from the standbys the cleanup removes.
func (c *cluster) forgetStandby(st *ownPostgres) {
	c.standbys = slices.DeleteFunc(c.standbys, func(o *ownPostgres) bool { return o == st })
}

// failoverLag is how long an asynchronous standby's stream is cut before the
// primary it follows dies.
const failoverLag = time.Second

// postgresFailover: an asynchronous standby streams under load for s.Hold,
// then is cut from the primary for failoverLag (the fault's StreamCut); then
// the primary is stopped immediately (what it had not sent is lost:
// acknowledged commits among it), the standby promoted and the proxy
// switched to it, while every service runs. Then the dead primary is read
// back (readDeadPrimary) for the checker.
func (in *injector) postgresFailover(ctx context.Context, s chaos.Step, f *chaos.Fault, record func(string)) error {
	c := in.c
	if c.pg == nil {
		return errors.New("the run has no PostgreSQL server of its own to fail over")
	}
	ctx = context.WithoutCancel(ctx) // a failover started is finished
	c.pgNodes++
	stream := "pg-stream-" + strconv.Itoa(c.pgNodes)
	st, err := c.newStandby(ctx, "chaos_async", stream)
	if err != nil {
		return err
	}
	time.Sleep(s.Hold)
	// The standby falls behind, as an asynchronous one does under a burst
	// or a slow network: its stream is cut for failoverLag before the
	// primary dies, so the commits the API acknowledged meanwhile are lost.
	f.StreamCut = time.Now()
	if err := c.toxi.disable(stream); err != nil {
		return err
	}
	time.Sleep(failoverLag)
	lag := c.standbyLag(ctx, st)
	f.Start = time.Now()
	old := c.pg
	if old.stopImmediately() == nil {
		return errors.New("own PostgreSQL was not running")
	}
	if err := c.promote(ctx, st); err != nil {
		return err
	}
	f.Measures = map[string]float64{"standby_lag_bytes_before_kill": lag}
	record(fmt.Sprintf("standby's stream cut for %v, primary stopped immediately, asynchronous standby (%.0f bytes behind) promoted on port %s, proxy switched", failoverLag, lag, st.port))
	// The dead primary's data, read back for the checker: what it held
	// beyond its successor is what the failover lost.
	dead, err := c.readDeadPrimary(ctx, old, f.StreamCut, f.Start)
	if err != nil {
		return err
	}
	c.deadPrimaries = append(c.deadPrimaries, dead)
	in.logf("postgres_failover: the dead primary held %d orders and %d outbox rows", len(dead.Orders), len(dead.Events))
	return nil
}

// standbyLag is how far, in WAL bytes, the standby's received position was
// behind the primary's current one, read in that order (0 when the standby
// caught up in between); -1 when it cannot be read.
func (c *cluster) standbyLag(ctx context.Context, st *ownPostgres) float64 {
	var primaryLSN, standbyLSN string
	for _, q := range []struct {
		url, sql string
		dst      *string
	}{
		{c.pg.url("postgres"), `SELECT pg_current_wal_lsn()::text`, &primaryLSN},
		{st.url("postgres"), `SELECT pg_last_wal_receive_lsn()::text`, &standbyLSN},
	} {
		conn, err := pgx.Connect(ctx, q.url)
		if err != nil {
			return -1
		}
		err = conn.QueryRow(ctx, q.sql).Scan(q.dst)
		_ = conn.Close(ctx)
		if err != nil {
			return -1
		}
	}
	conn, err := pgx.Connect(ctx, c.pg.url("postgres"))
	if err != nil {
		return -1
	}
	defer conn.Close(ctx)
	var lag float64
	if err := conn.QueryRow(ctx, `SELECT pg_wal_lsn_diff($1::pg_lsn, $2::pg_lsn)`, primaryLSN, standbyLSN).Scan(&lag); err != nil {
		return -1
	}
	return max(lag, 0)
}

// postgresSyncStall names a fresh standby in synchronous_standby_names,
// stops it for s.Hold (every commit waits for it, the transactions stay
// invisible), and meanwhile looks for the phantom the WAL relay could make:
// an effect in shipping whose order, or whose version of the order, the
// primary does not show, and shows once the wait ends. Then the standby
// starts again, catches up, and the setting and the standby go. A commit whose wait a client cancels is
// committed locally by PostgreSQL (and may be published): that is no
// phantom, and the check, which reads what is visible, does not count it.
func (in *injector) postgresSyncStall(ctx context.Context, s chaos.Step, f *chaos.Fault, record func(string)) error {
	c := in.c
	if c.pg == nil {
		return errors.New("the run has no PostgreSQL server of its own")
	}
	ctx = context.WithoutCancel(ctx) // a stall started is healed
	const name = "chaos_sync"
	st, err := c.newStandby(ctx, name, "")
	if err != nil {
		return err
	}
	setSync := func(value string) error {
		conn, err := pgx.Connect(ctx, c.pg.url("postgres"))
		if err != nil {
			return fmt.Errorf("synchronous_standby_names: %w", err)
		}
		defer conn.Close(ctx)
		q := `ALTER SYSTEM RESET synchronous_standby_names`
		if value != "" {
			q = `ALTER SYSTEM SET synchronous_standby_names = '` + value + `'` // a constant name
		}
		if _, err := conn.Exec(ctx, q); err != nil {
			return fmt.Errorf("synchronous_standby_names: %w", err)
		}
		_, err = conn.Exec(ctx, `SELECT pg_reload_conf()`)
		return err
	}
	if err := setSync(name); err != nil {
		return err
	}
	err = pollPostgres(ctx, c.pg.url("postgres"), 30*time.Second, func(conn *pgx.Conn) (bool, error) {
		var n int
		err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_stat_replication WHERE application_name = $1 AND sync_state = 'sync'`, name).Scan(&n)
		return n > 0, err
	})
	if err != nil {
		return errors.Join(fmt.Errorf("standby %s never synchronous: %w", name, err), setSync(""))
	}
	f.Start = time.Now()
	st.p.stop()
	time.Sleep(s.Hold)
	unseen, checked, perr := c.invisibleEffects(ctx, f.Start)
	// Heal: the standby back (the waiting commits complete), then the
	// setting and the standby removed.
	err = errors.Join(perr, st.start(ctx))
	err = errors.Join(err, setSync(""))
	c.forgetStandby(st)
	err = errors.Join(err, st.close())
	if err != nil {
		return err
	}
	// A phantom is of a commit that was waiting: it shows once the wait
	// ends. An effect whose order version still does not show is of an
	// event the database never committed, or lost in an earlier
	// asynchronous failover and published from the old primary before it
	// died, applied late: the final check classifies it (failover orphan,
	// or unknown effect), it is no phantom of this stall.
	phantoms, orphans, err := c.shownAfterTheWait(ctx, unseen)
	if err != nil {
		return err
	}
	f.Measures = map[string]float64{chaos.MeasurePhantomEffects: float64(len(phantoms)), "effects_checked": float64(checked), "effects_never_shown": float64(len(orphans))}
	detail := fmt.Sprintf("synchronous standby stopped, commits waiting; %d effects applied meanwhile, each of a visible order version", checked)
	if len(phantoms) > 0 {
		detail = fmt.Sprintf("synchronous standby stopped; %d of %d effects applied meanwhile were of order versions that showed only once the wait ended: %v", len(phantoms), checked, phantoms)
	}
	if len(orphans) > 0 {
		detail += fmt.Sprintf("; %d of no order version the database shows even after the wait (left to the final check): %v", len(orphans), orphans)
	}
	record(detail + "; standby started again, setting removed")
	return nil
}

// effectKey is an effect's order and version.
type effectKey struct {
	OrderID string
	Version int64
}

func (k effectKey) String() string { return k.OrderID + "/v" + strconv.FormatInt(k.Version, 10) }

// shownAfterTheWait splits effects whose order version the primary did not
// show during a stall into phantoms (the version shows within 30 s of the
// wait's end: its commit was waiting) and the others.
func (c *cluster) shownAfterTheWait(ctx context.Context, unseen []effectKey) (phantoms, never []string, err error) {
	if len(unseen) == 0 {
		return nil, nil, nil
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		visible, err := c.orderVersions(ctx, unseen)
		if err != nil {
			return nil, nil, err
		}
		phantoms, never = nil, nil
		for _, e := range unseen {
			if visible[e.OrderID] >= e.Version {
				phantoms = append(phantoms, e.String())
			} else {
				never = append(never, e.String())
			}
		}
		if len(never) == 0 || time.Now().After(deadline) {
			return phantoms, never, nil
		}
		time.Sleep(time.Second)
	}
}

// orderVersions returns the version the primary shows of each order of
// effects (absent: no such order).
func (c *cluster) orderVersions(ctx context.Context, effects []effectKey) (map[string]int64, error) {
	ids := make([]string, len(effects))
	for i, e := range effects {
		ids[i] = e.OrderID
	}
	conn, err := pgx.Connect(ctx, replaceDatabase(c.pg.url("postgres"), c.id))
	if err != nil {
		return nil, fmt.Errorf("phantom check: %w", err)
	}
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, `SELECT id::text, version FROM orders WHERE id = ANY($1::uuid[])`, ids)
	if err != nil {
		return nil, fmt.Errorf("phantom check: read orders: %w", err)
	}
	visible := make(map[string]int64)
	for rows.Next() {
		var id string
		var v int64
		if err := rows.Scan(&id, &v); err != nil {
			return nil, fmt.Errorf("phantom check: read orders: %w", err)
		}
		visible[id] = v
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("phantom check: read orders: %w", err)
	}
	return visible, nil
}

// invisibleEffects lists the effects shipping applied since since whose
// order version the primary does not show, and how many effects it
// checked. MongoDB is read first: what is visible in PostgreSQL afterwards
// was visible before the effect only if the commit was not waiting, and
// while the standby is stopped no waiting commit becomes visible.
func (c *cluster) invisibleEffects(ctx context.Context, since time.Time) ([]effectKey, int, error) {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	client, err := mongo.Connect(options.Client().ApplyURI("mongodb://" + c.mongo.addr() + "/" + c.mongo.uriQuery()).
		SetServerSelectionTimeout(30 * time.Second))
	if err != nil {
		return nil, 0, fmt.Errorf("phantom check: %w", err)
	}
	defer func() { _ = client.Disconnect(context.WithoutCancel(ctx)) }()
	cur, err := client.Database(c.id).Collection(shipmentsCollection).Find(ctx, bson.D{
		{Key: "applied_at", Value: bson.D{{Key: "$gte", Value: since}}},
		{Key: "event_type", Value: bson.D{{Key: "$in", Value: bson.A{chaos.EventCreated, chaos.EventCancelled}}}},
	})
	if err != nil {
		return nil, 0, fmt.Errorf("phantom check: read effects: %w", err)
	}
	var effects []struct {
		OrderID string `bson:"order_id"`
		Version int64  `bson:"version"`
	}
	if err := cur.All(ctx, &effects); err != nil {
		return nil, 0, fmt.Errorf("phantom check: read effects: %w", err)
	}
	if len(effects) == 0 {
		return nil, 0, nil
	}
	keys := make([]effectKey, len(effects))
	for i, e := range effects {
		keys[i] = effectKey{e.OrderID, e.Version}
	}
	visible, err := c.orderVersions(ctx, keys)
	if err != nil {
		return nil, 0, err
	}
	var unseen []effectKey
	for _, e := range keys {
		if visible[e.OrderID] < e.Version {
			unseen = append(unseen, e)
		}
	}
	return unseen, len(effects), nil
}
