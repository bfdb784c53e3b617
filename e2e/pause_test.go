package e2e

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-inbox/reference/e2e/chaos"
)

// The pause nemesis (SIGSTOP, then SIGCONT) and the faults on the path to
// PostgreSQL (toxics on its proxies, one relay cut alone). See
// e2e/chaos/pause.go for what each kind claims; each fault here measures that
// it did: the process was stopped (its state read from /proc), and what the
// others did meanwhile.

// relayLease and walTakeover are what a relay pause must outlast: the
// relays' RELAY_LEASE (ordersEnv), and, with the WAL relay, the run's own
// PostgreSQL's wal_sender_timeout (ownPostgresArgs) before it frees the
// paused holder's slot, plus the waiting relay's TakeoverInterval (1s by
// default). A holder paused inside a transaction holds the slot's row until
// the server ends its session (outboxwal's idle_in_transaction_session_timeout,
// 10s), and the takeover waits for that: the pause goes on until the slot
// moved (pauseWALRelay).
const (
	relayLease  = 6 * time.Second
	walTakeover = 5*time.Second + time.Second
)

// relayDatabaseURLFor is relay name's DATABASE_URL: on the run's own
// PostgreSQL, through a proxy of its own (chaos.PostgresProxyName), so that
// one relay can be cut from the database alone while the others, the API and
// the harness still reach it.
func (c *cluster) relayDatabaseURLFor(name string) (string, error) {
	kv := c.relayDatabaseURL()
	if c.pg == nil {
		return kv, nil
	}
	addr, err := c.toxi.add(chaos.PostgresProxyName(name), c.pg.addr())
	if err != nil {
		return "", err
	}
	u, err := url.Parse(strings.TrimPrefix(kv, "DATABASE_URL="))
	if err != nil {
		return "", fmt.Errorf("relay %s's database URL: %w", name, err)
	}
	u.Host = addr
	q := u.Query()
	q.Set("application_name", name)
	u.RawQuery = q.Encode()
	return "DATABASE_URL=" + u.String(), nil
}

// postgresProxies are every proxy in front of the run's own PostgreSQL: the
// API's and the harness's, and each relay's. A failover points them all at
// the new primary.
func (c *cluster) postgresProxies() []string {
	names := []string{proxyPostgres}
	for _, p := range c.relays {
		name := chaos.PostgresProxyName(p.spec.name)
		if _, err := c.toxi.proxy(name); err == nil {
			names = append(names, name)
		}
	}
	return names
}

// directDB connects to the run's database without a proxy when the run has
// its own server (a fault on the proxies must not stop the harness's
// measures), else through the usual URL.
func (c *cluster) directDB(ctx context.Context) (*pgx.Conn, error) {
	u := c.dbURL
	c.pgMu.RLock()
	if c.pg != nil {
		u = c.pg.url(c.id)
	}
	c.pgMu.RUnlock()
	conn, err := pgx.Connect(ctx, u)
	if err != nil {
		return nil, fmt.Errorf("connect to the run's database: %w", err)
	}
	return conn, nil
}

// measureDB is the harness's connection for a fault's measures: straight to
// the server (directDB), connected again when a query fails (another fault,
// postgres_kill_sessions, may have ended the session).
type measureDB struct {
	c    *cluster
	conn *pgx.Conn
}

// do runs fn on the connection, up to three times, each within 10s.
func (m *measureDB) do(ctx context.Context, fn func(ctx context.Context, conn *pgx.Conn) error) error {
	ctx = context.WithoutCancel(ctx)
	var err error
	for try := range 3 {
		if try > 0 {
			time.Sleep(300 * time.Millisecond)
		}
		qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		if m.conn == nil {
			if m.conn, err = m.c.directDB(qctx); err != nil {
				cancel()
				continue
			}
		}
		err = fn(qctx, m.conn)
		cancel()
		if err == nil {
			return nil
		}
		m.close()
	}
	return err
}

func (m *measureDB) close() {
	if m.conn != nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = m.conn.Close(ctx)
		m.conn = nil
	}
}

// publishedSince counts the events marked published since t.
func (m *measureDB) publishedSince(ctx context.Context, t time.Time) (int64, error) {
	var n int64
	err := m.do(ctx, func(ctx context.Context, conn *pgx.Conn) error {
		return conn.QueryRow(ctx, `SELECT count(*) FROM outbox_published WHERE published_at >= $1`, t).Scan(&n)
	})
	return n, err
}

// stopped is a process group stopped by SIGSTOP.
type stopped struct {
	pids []int // the processes stopped, the first the target's own
}

// sigstop stops the process pid and then each of extra, and waits until
// /proc shows every one stopped (state T): the proof the pause holds. One of
// extra that exits meanwhile (a backend whose session ended: a zombie until
// its parent, stopped, reaps it) runs no more either.
func sigstop(pid int, extra ...int) (*stopped, error) {
	st := &stopped{}
	for i, p := range append([]int{pid}, extra...) {
		if err := syscall.Kill(p, syscall.SIGSTOP); err != nil {
			if i > 0 && errors.Is(err, syscall.ESRCH) {
				continue
			}
			_ = st.cont()
			return nil, fmt.Errorf("SIGSTOP %d: %w", p, err)
		}
		st.pids = append(st.pids, p)
	}
	deadline := time.Now().Add(5 * time.Second)
	for i, p := range st.pids {
		for {
			state, err := procState(p)
			if err == nil && (state == "T" || state == "t") {
				break
			}
			if i > 0 && (errors.Is(err, os.ErrNotExist) || state == "Z" || state == "X") {
				break // exited: it runs no more
			}
			if time.Now().After(deadline) {
				_ = st.cont()
				return nil, fmt.Errorf("process %d not stopped 5s after SIGSTOP (state %q, %v)", p, state, err)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	return st, nil
}

// cont sends SIGCONT to every stopped process, the target last (the
// postmaster resumes once its children can answer it).
func (st *stopped) cont() error {
	var errs []error
	for _, p := range slices.Backward(st.pids) {
		if err := syscall.Kill(p, syscall.SIGCONT); err != nil && !errors.Is(err, syscall.ESRCH) {
			errs = append(errs, fmt.Errorf("SIGCONT %d: %w", p, err))
		}
	}
	return errors.Join(errs...)
}

// procState is the state letter of /proc/pid/stat (R, S, D, T ...).
func procState(pid int) (string, error) {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return "", err
	}
	// pid (comm) state ...: comm may hold spaces and parentheses.
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 || i+2 >= len(b) {
		return "", fmt.Errorf("/proc/%d/stat: %q", pid, b)
	}
	return string(b[i+2]), nil
}

// children lists the processes whose parent is pid (a postmaster's backends
// and auxiliary processes).
func children(pid int) ([]int, error) {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil, fmt.Errorf("list processes: %w", err)
	}
	var out []int
	for _, e := range entries {
		child, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue // exited meanwhile
		}
		s := string(b)
		i := strings.LastIndexByte(s, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(s[i+1:])
		if len(f) > 1 && f[1] == strconv.Itoa(pid) {
			out = append(out, child)
		}
	}
	return out, nil
}

// pid is the running incarnation's process id, starting the process if none
// runs.
func (p *proc) pid() (int, *incarnation, error) {
	inc := p.current()
	if inc == nil {
		if err := p.ensureRunning(); err != nil {
			return 0, nil, err
		}
		if inc = p.current(); inc == nil {
			return 0, nil, fmt.Errorf("%s is not running", p.spec.name)
		}
	}
	return inc.cmd.Process.Pid, inc, nil
}

// resumeAll sends SIGCONT to every service process and to the run's
// PostgreSQL servers and their children: whatever a pause left stopped (a
// step that failed half-way, a test that ended during a pause) runs again.
// SIGCONT to a running process does nothing.
func (c *cluster) resumeAll() {
	for _, p := range c.procs {
		if inc := p.current(); inc != nil {
			_ = syscall.Kill(inc.cmd.Process.Pid, syscall.SIGCONT)
		}
	}
	for _, pg := range append([]*ownPostgres{c.pg}, c.standbys...) {
		if pg == nil || pg.p == nil {
			continue
		}
		if inc := pg.p.current(); inc != nil {
			pid := inc.cmd.Process.Pid
			kids, _ := children(pid)
			for _, k := range kids {
				_ = syscall.Kill(k, syscall.SIGCONT)
			}
			_ = syscall.Kill(pid, syscall.SIGCONT)
		}
	}
}

// pause carries out a pause step: SIGSTOP of the target for s.Hold (longer
// when what it must outlast needs it), SIGCONT, and records what happened
// meanwhile.
func (in *injector) pause(ctx context.Context, s chaos.Step, f *chaos.Fault, record func(string)) error {
	switch s.Kind {
	case chaos.FaultPauseRelay:
		if os.Getenv("CHAOS_RELAY_MODE") == "wal" {
			return in.pauseWALRelay(ctx, s, f, record)
		}
		return in.pausePollingRelay(ctx, s, f, record)
	case chaos.FaultPauseShipping:
		return in.pauseShipping(ctx, s, f, record)
	case chaos.FaultPauseOrders:
		return in.pauseOrders(ctx, s, f, record)
	case chaos.FaultPausePostgres:
		return in.pausePostgres(ctx, s, f, record)
	}
	return fmt.Errorf("not a pause: %s", s.Kind)
}

// stopProc stops the target process and returns what resumes it. The
// deferred resume of every caller runs even if the step fails half-way.
func (in *injector) stopProc(name string, f *chaos.Fault) (*stopped, error) {
	p, ok := in.c.procs[name]
	if !ok {
		return nil, fmt.Errorf("no process %q", name)
	}
	pid, _, err := p.pid()
	if err != nil {
		return nil, err
	}
	st, err := sigstop(pid)
	if err != nil {
		return nil, err
	}
	f.Start = time.Now()
	return st, nil
}

// resumed sends SIGCONT and returns the pause's actual length.
func resumed(st *stopped, f *chaos.Fault) (time.Duration, error) {
	err := st.cont()
	return time.Since(f.Start), err
}

// pausePollingRelay pauses a polling relay past its lease while it holds
// one: the other relays are stopped for a moment (at most 3 s, half their
// lease), so that the rows leased meanwhile are the target's, and the target
// is stopped as soon as it holds some (up to three tries). At the end it
// counts which of those another relay claimed again after their lease and
// published, and how many events the others published meanwhile; the
// resumed relay then publishes its batch again (duplicates) and finds the
// rows gone when it marks.
func (in *injector) pausePollingRelay(ctx context.Context, s chaos.Step, f *chaos.Fault, record func(string)) error {
	db := &measureDB{c: in.c}
	defer db.close()
	type leased struct{ id, attempts int64 }
	scan := func(r pgx.CollectableRow) (leased, error) {
		var l leased
		return l, r.Scan(&l.id, &l.attempts)
	}
	held := func() (out []leased, err error) {
		err = db.do(ctx, func(ctx context.Context, conn *pgx.Conn) error {
			rows, err := conn.Query(ctx, `SELECT id, attempts FROM outbox WHERE in_flight AND leased_until > now()`)
			if err == nil {
				out, err = pgx.CollectRows(rows, scan)
			}
			return err
		})
		return out, err
	}
	// The target is the only relay running while the others are stopped
	// for a moment (at most 3 s, half their lease): the rows leased then
	// that were not before are its own.
	var others []*stopped
	contOthers := func() {
		for _, o := range others {
			_ = o.cont()
		}
		others = nil
	}
	defer contOthers()
	stopOthers := func() error {
		for _, p := range in.c.relays {
			if p.spec.name == s.Target {
				continue
			}
			if inc := p.current(); inc != nil {
				o, err := sigstop(inc.cmd.Process.Pid)
				if err != nil {
					return err
				}
				others = append(others, o)
			}
		}
		return nil
	}
	minus := func(a, b []leased) []leased {
		return slices.DeleteFunc(slices.Clone(a), func(r leased) bool { return slices.Contains(b, r) })
	}
	var (
		st      *stopped
		rows    []leased
		tries   int
		heldErr error
	)
	for tries = 1; ; tries++ {
		if err := stopOthers(); err != nil {
			return err
		}
		before, _ := held()
		var mine []leased
		for wait := time.Now().Add(3 * time.Second); time.Now().Before(wait) && ctx.Err() == nil; time.Sleep(10 * time.Millisecond) {
			if cur, err := held(); err == nil {
				if mine = minus(cur, before); len(mine) > 0 {
					break
				}
			}
		}
		var err error
		st, err = in.stopProc(s.Target, f)
		contOthers()
		if err != nil {
			return err
		}
		// Its mark may have landed between the read and the stop.
		cur, err := held()
		rows, heldErr = minus(mine, minus(mine, cur)), err
		if len(rows) > 0 || tries == 3 || err != nil || ctx.Err() != nil {
			break
		}
		if err := st.cont(); err != nil {
			return err
		}
		sleep(ctx, 200*time.Millisecond)
	}
	defer func() { _ = st.cont() }()
	hold := max(s.Hold, relayLease+2*time.Second)
	sleep(ctx, time.Until(f.Start.Add(hold)))
	// Read before SIGCONT: only the others can have published.
	byOthers, oerr := db.publishedSince(ctx, f.Start)
	takenOver, stillThere := 0, ""
	var terr error
	if len(rows) > 0 {
		ids := make([]int64, len(rows))
		attempts := make(map[int64]int64, len(rows))
		for i, r := range rows {
			ids[i], attempts[r.id] = r.id, r.attempts
		}
		terr = db.do(ctx, func(ctx context.Context, conn *pgx.Conn) error {
			got, err := conn.Query(ctx, `SELECT id, attempts FROM outbox_published WHERE id = ANY($1)`, ids)
			if err != nil {
				return err
			}
			pub, err := pgx.CollectRows(got, scan)
			takenOver = 0
			for _, p := range pub {
				if p.attempts > attempts[p.id] {
					takenOver++
				}
			}
			if err != nil || takenOver == len(rows) {
				return err
			}
			// What became of the others, for the detail.
			var states []string
			err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
				rs, err := tx.Query(ctx, `
					SELECT format('%s: attempts %s, in_flight %s, blocked %s, suspect %s, due in %s', id, attempts, in_flight, blocked, suspect,
					              date_trunc('milliseconds', greatest(next_attempt_at, leased_until) - now()))
					FROM outbox WHERE id = ANY($1) ORDER BY id`, ids)
				if err == nil {
					states, err = pgx.CollectRows(rs, pgx.RowTo[string])
				}
				return err
			})
			stillThere = strings.Join(states, "; ")
			return err
		})
	}
	length, err := resumed(st, f)
	if err != nil {
		return err
	}
	f.Measures = map[string]float64{"pause_s": length.Seconds(), "lease_s": relayLease.Seconds(),
		"leased_when_paused": float64(len(rows))}
	lease := fmt.Sprintf("it held %d leased rows when paused (try %d)", len(rows), tries)
	switch {
	case len(rows) == 0 && heldErr != nil:
		lease = "its leased rows unknown: " + heldErr.Error()
	case len(rows) == 0:
		lease = fmt.Sprintf("it claimed nothing in %d tries (no row due)", tries)
	case terr != nil:
		lease += ", what became of them unknown: " + terr.Error()
	default:
		f.Measures["taken_over"] = float64(takenOver)
		lease += fmt.Sprintf(": %d of them claimed again after the lease and published by another relay", takenOver)
		if stillThere != "" {
			lease += " (still in the outbox: " + stillThere + ")"
		}
	}
	published := fmt.Sprintf("%d events published by the others meanwhile", byOthers)
	if oerr != nil {
		published = "events published meanwhile unknown: " + oerr.Error()
	} else {
		f.Measures["published_by_others"] = float64(byOthers)
	}
	record(fmt.Sprintf("SIGSTOP %.1fs (lease %v); %s; %s; SIGCONT", length.Seconds(), relayLease, lease, published))
	return nil
}

// walSlot reads who holds the WAL relay's slot: the epoch, the holder's pid
// (outbox_wal_slots.holder ends in "pid N") and whether a session streams.
func (c *cluster) walSlot(ctx context.Context, db *measureDB) (epoch int64, pid int, active bool, err error) {
	slot := ""
	for _, kv := range relayModeEnv(c.id) {
		if v, ok := strings.CutPrefix(kv, "RELAY_WAL_SLOT="); ok {
			slot = v
		}
	}
	var holder string
	err = db.do(ctx, func(ctx context.Context, conn *pgx.Conn) error {
		return conn.QueryRow(ctx, `
		SELECT s.epoch, s.holder, coalesce((SELECT active FROM pg_replication_slots r WHERE r.slot_name = s.slot_name), false)
		FROM outbox_wal_slots s WHERE s.slot_name = $1`, slot).Scan(&epoch, &holder, &active)
	})
	if err != nil {
		return 0, 0, false, fmt.Errorf("read slot %s's holder: %w", slot, err)
	}
	if i := strings.LastIndex(holder, " pid "); i >= 0 {
		pid, _ = strconv.Atoi(holder[i+len(" pid "):])
	}
	return epoch, pid, active, nil
}

// relayByPid names the relay whose running incarnation is pid, "" if none.
func (c *cluster) relayByPid(pid int) string {
	for _, p := range c.relays {
		if inc := p.current(); inc != nil && inc.cmd.Process.Pid == pid {
			return p.spec.name
		}
	}
	return ""
}

// walHolderWait bounds pauseWALRelay's wait for a relay streaming from the
// slot: long enough for a PostgreSQL restart or failover that overlaps it.
const walHolderWait = time.Minute

// pauseWALRelay pauses the relay that holds the slot (whatever the plan
// drew: the step locks every relay) past wal_sender_timeout and the
// takeover, and records when the slot moved to the other relay (a new
// epoch, which fences the paused one off), then that, resumed, it did not
// take the slot back.
func (in *injector) pauseWALRelay(ctx context.Context, s chaos.Step, f *chaos.Fault, record func(string)) error {
	db := &measureDB{c: in.c}
	defer db.close()
	var (
		epoch  int64
		holder string
	)
	// A PostgreSQL fault may overlap the wait (the step does not lock
	// "postgres"): a restart or a failover takes up to about 10 s, then the
	// relays reconnect with their backoff and one takes the slot.
	deadline := time.Now().Add(walHolderWait)
	for {
		e, pid, active, err := in.c.walSlot(ctx, db)
		if err == nil && active {
			if holder = in.c.relayByPid(pid); holder != "" {
				epoch = e
				break
			}
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("no relay of the run streams from the slot (last: %v)", err)
		}
		sleep(ctx, 250*time.Millisecond)
	}
	f.Target = holder
	st, err := in.stopProc(holder, f)
	if err != nil {
		return err
	}
	defer func() { _ = st.cont() }()
	hold := max(s.Hold, walTakeover+2*time.Second)
	var (
		moved   time.Duration
		newer   string
		newEpoc int64
	)
	// Past the hold, the pause goes on (up to 20 s more) until the slot
	// moved: that is what it is for.
	for end := f.Start.Add(hold); ; {
		if moved == 0 {
			if e, pid, active, err := in.c.walSlot(ctx, db); err == nil && active && e > epoch {
				if name := in.c.relayByPid(pid); name != "" && name != holder {
					moved, newer, newEpoc = time.Since(f.Start), name, e
				}
			}
		}
		if ctx.Err() != nil || time.Now().After(end) && (moved > 0 || time.Now().After(end.Add(20*time.Second))) {
			break
		}
		sleep(ctx, 250*time.Millisecond)
	}
	length, err := resumed(st, f)
	if err != nil {
		return err
	}
	if moved == 0 {
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("the slot did not move while %s was paused %.1fs (epoch %d)", holder, length.Seconds(), epoch)
	}
	// The resumed relay is fenced off: it must not take the slot back while
	// the other one streams.
	sleep(ctx, 3*time.Second)
	e, pid, _, err := in.c.walSlot(ctx, db)
	after := fmt.Sprintf("3s after SIGCONT the slot is at epoch %d, held by %s", e, cmp.Or(in.c.relayByPid(pid), "pid "+strconv.Itoa(pid)))
	if err != nil {
		after = "3s after SIGCONT: " + err.Error()
	}
	f.Measures = map[string]float64{"pause_s": length.Seconds(), "slot_moved_after_s": moved.Seconds(),
		"epoch_before": float64(epoch), "epoch_taken": float64(newEpoc)}
	record(fmt.Sprintf("SIGSTOP of %s, the slot's holder (the plan drew %s), %.1fs (wal_sender_timeout + takeover %v, or the holder's transaction ended by the server); the slot moved to %s (epoch %d -> %d) %.1fs into the pause; SIGCONT; %s",
		holder, s.Target, length.Seconds(), walTakeover, newer, epoch, newEpoc, moved.Seconds(), after))
	return nil
}

// pauseShipping pauses a consumer with its deliveries unacked, and counts
// the effects the other consumers applied meanwhile (from MongoDB directly).
func (in *injector) pauseShipping(ctx context.Context, s chaos.Step, f *chaos.Fault, record func(string)) error {
	st, err := in.stopProc(s.Target, f)
	if err != nil {
		return err
	}
	defer func() { _ = st.cont() }()
	before, berr := in.c.appliedCount(ctx)
	sleep(ctx, time.Until(f.Start.Add(s.Hold)))
	after, aerr := in.c.appliedCount(ctx)
	length, err := resumed(st, f)
	if err != nil {
		return err
	}
	others := fmt.Sprintf("%d effects applied by the other consumers meanwhile", after-before)
	if err := errors.Join(berr, aerr); err != nil {
		others = "effects applied meanwhile unknown: " + err.Error()
	} else {
		f.Measures = map[string]float64{"pause_s": length.Seconds(), "applied_by_others": float64(after - before)}
	}
	record(fmt.Sprintf("SIGSTOP %.1fs (AMQP heartbeat 10s), deliveries unacked; %s; SIGCONT", length.Seconds(), others))
	return nil
}

// pauseOrders pauses the API with requests in flight, and shows it frozen:
// /healthz does not answer during the pause, and answers again after.
func (in *injector) pauseOrders(ctx context.Context, s chaos.Step, f *chaos.Fault, record func(string)) error {
	st, err := in.stopProc(s.Target, f)
	if err != nil {
		return err
	}
	defer func() { _ = st.cont() }()
	client := &http.Client{Timeout: time.Second}
	defer client.CloseIdleConnections()
	healthy := func() bool {
		req, err := http.NewRequestWithContext(context.WithoutCancel(ctx), http.MethodGet, in.c.ordersURL+"/healthz", nil)
		if err != nil {
			return false
		}
		resp, err := client.Do(req)
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}
	frozen := !healthy()
	sleep(ctx, time.Until(f.Start.Add(s.Hold)))
	length, err := resumed(st, f)
	if err != nil {
		return err
	}
	var back time.Duration
	for start := time.Now(); ; {
		if healthy() {
			back = time.Since(start)
			break
		}
		if time.Since(start) > 30*time.Second {
			return fmt.Errorf("the orders API does not answer /healthz 30s after SIGCONT")
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !frozen {
		return errors.New("the orders API answered /healthz while stopped")
	}
	f.Measures = map[string]float64{"pause_s": length.Seconds(), "healthz_after_s": back.Seconds()}
	record(fmt.Sprintf("SIGSTOP %.1fs with requests in flight: /healthz timed out meanwhile; SIGCONT, answered %.2fs later", length.Seconds(), back.Seconds()))
	return nil
}

// pausePostgres freezes the run's own PostgreSQL: the postmaster, then every
// child (each child of a postmaster leads a process group of its own, so the
// postmaster's group holds only itself). Stopping the postmaster alone would
// stop only new connections; the backends of the pools would go on. A query
// straight to the server must time out meanwhile and answer after SIGCONT.
func (in *injector) pausePostgres(ctx context.Context, s chaos.Step, f *chaos.Fault, record func(string)) error {
	if in.c.pg == nil {
		return errors.New("the run has no PostgreSQL of its own to pause")
	}
	pid, _, err := in.c.pg.p.pid()
	if err != nil {
		return err
	}
	// The postmaster first: stopped, it forks no new child.
	st, err := sigstop(pid)
	if err != nil {
		return err
	}
	defer func() { _ = st.cont() }()
	f.Start = time.Now()
	kids, err := children(pid)
	if err != nil {
		return err
	}
	if len(kids) == 0 {
		return fmt.Errorf("the postmaster %d has no children to stop", pid)
	}
	more, err := sigstop(kids[0], kids[1:]...)
	if err != nil {
		return err
	}
	st.pids = append(st.pids, more.pids...)
	query := func(timeout time.Duration) error {
		qctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), timeout)
		defer cancel()
		conn, err := pgx.Connect(qctx, in.c.pg.url(in.c.id))
		if err != nil {
			return err
		}
		defer conn.Close(context.WithoutCancel(ctx))
		var one int
		return conn.QueryRow(qctx, `SELECT 1`).Scan(&one)
	}
	frozen := query(time.Second) != nil
	sleep(ctx, time.Until(f.Start.Add(s.Hold)))
	length, err := resumed(st, f)
	if err != nil {
		return err
	}
	start := time.Now()
	if err := query(30 * time.Second); err != nil {
		return fmt.Errorf("PostgreSQL does not answer 30s after SIGCONT: %w", err)
	}
	back := time.Since(start)
	if !frozen {
		return errors.New("PostgreSQL answered a query while stopped")
	}
	f.Measures = map[string]float64{"pause_s": length.Seconds(), "processes": float64(len(st.pids)), "answered_after_s": back.Seconds()}
	record(fmt.Sprintf("SIGSTOP of the postmaster and its %d children %.1fs: a query timed out meanwhile; SIGCONT, answered %.2fs later",
		len(st.pids)-1, length.Seconds(), back.Seconds()))
	return nil
}

// postgresPath carries out a fault on a PostgreSQL proxy: a toxic on both
// directions, or (postgres_relay_cut) the relay's proxy disabled while it
// still reaches the broker.
func (in *injector) postgresPath(ctx context.Context, s chaos.Step, f *chaos.Fault, record func(string)) error {
	if in.c.pg == nil {
		return errors.New("the run has no PostgreSQL of its own: no proxy in front of it")
	}
	switch s.Kind {
	case chaos.FaultPostgresProxyLatency:
		return in.toxicOn(ctx, []string{s.Target}, s, "latency", map[string]any{"latency": 300, "jitter": 100}, record)
	case chaos.FaultPostgresProxyTimeout:
		// timeout 0: the bytes are swallowed until the toxic goes, no reset.
		return in.toxicOn(ctx, []string{s.Target}, s, "timeout", map[string]any{"timeout": 0}, record)
	case chaos.FaultPostgresProxyResetPeer:
		return in.toxicOn(ctx, []string{s.Target}, s, "reset_peer", map[string]any{"timeout": 0}, record)
	case chaos.FaultPostgresRelayCut:
		db := &measureDB{c: in.c}
		defer db.close()
		if err := in.c.toxi.disable(s.Target); err != nil {
			return err
		}
		f.Start = time.Now()
		sleep(ctx, s.Hold)
		n, err := db.publishedSince(ctx, f.Start)
		if eerr := in.c.toxi.enable(s.Target); eerr != nil {
			return eerr
		}
		published := fmt.Sprintf("%d events published meanwhile", n)
		if err != nil {
			published = "events published meanwhile unknown: " + err.Error()
		} else {
			f.Measures = map[string]float64{"published_meanwhile": float64(n)}
		}
		record("proxy disabled: the relay cut from PostgreSQL, not from the broker; " + published)
		return nil
	}
	return fmt.Errorf("not a PostgreSQL path fault: %s", s.Kind)
}

// toxicOn adds a toxic to both directions of the named proxies for s.Hold.
func (in *injector) toxicOn(ctx context.Context, proxies []string, s chaos.Step, typ string, attrs map[string]any, record func(string)) error {
	name := fmt.Sprintf("chaos_%s_%d", typ, time.Now().UnixNano())
	var errs []error
	for _, proxy := range proxies {
		for _, stream := range []string{"upstream", "downstream"} {
			if err := in.c.toxi.addToxic(proxy, name+"_"+stream, typ, stream, attrs); err != nil {
				errs = append(errs, err)
			}
		}
	}
	if err := errors.Join(errs...); err == nil {
		sleep(ctx, s.Hold)
	}
	for _, proxy := range proxies {
		for _, stream := range []string{"upstream", "downstream"} {
			errs = append(errs, in.c.toxi.removeToxic(context.WithoutCancel(ctx), proxy, name+"_"+stream))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	record(fmt.Sprintf("%s toxic %v", typ, attrs))
	return nil
}

// shellWithTwoChildren runs sh -c script as a supervised process (closed
// when the test ends) and waits until it has two children.
func shellWithTwoChildren(t *testing.T, script string) (p *proc, pid int, kids []int) {
	t.Helper()
	sh, err := exec.LookPath("sh")
	if err != nil {
		t.Fatalf("no sh: %v", err)
	}
	p, err = newProc(procSpec{name: "parent", bin: sh, args: []string{"-c", script}}, t.TempDir(), func(exitEvent) {})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.close() })
	if pid, _, err = p.pid(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { kids, _ = children(pid); return len(kids) == 2 })
	return p, pid, kids
}

// The pause's own parts: a process and its children stopped (state T in
// /proc) and running again after SIGCONT, and resumeAll continuing whatever
// a step left stopped.
func TestSigstopStopsAChildrenTreeAndResumeAllContinuesIt(t *testing.T) {
	p, pid, kids := shellWithTwoChildren(t, "sleep 60 & sleep 60 & wait")
	st, err := sigstop(pid, kids...)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range append([]int{pid}, kids...) {
		if s, err := procState(k); err != nil || s != "T" {
			t.Errorf("process %d in state %q (%v) after SIGSTOP, want T", k, s, err)
		}
	}
	if err := st.cont(); err != nil {
		t.Fatal(err)
	}
	for _, k := range append([]int{pid}, kids...) {
		waitFor(t, func() bool { s, _ := procState(k); return s == "S" || s == "R" })
	}
	// A step that failed half-way: resumeAll continues the service process.
	if _, err := sigstop(pid); err != nil {
		t.Fatal(err)
	}
	(&cluster{procs: map[string]*proc{"parent": p}}).resumeAll()
	waitFor(t, func() bool { s, _ := procState(pid); return s == "S" || s == "R" })
	// And a stopped process still stops when asked (proc.signal continues it).
	if _, err := sigstop(pid); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { p.stop(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("a stopped process did not end on SIGTERM")
	}
}

// A postmaster's child may exit between the listing of the children and the
// SIGSTOP (a session ending): it stays a zombie, its parent stopped, and
// runs no more. The pause goes on (seen in a run: "process 27155 not stopped
// 5s after SIGSTOP (state Z)" failed pause_postgres).
func TestSigstopTakesAChildThatExitedForStopped(t *testing.T) {
	_, pid, kids := shellWithTwoChildren(t, "sleep 0.3 & sleep 60 & wait")
	parent, err := sigstop(pid)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = parent.cont() }()
	waitFor(t, func() bool {
		for _, k := range kids {
			if s, _ := procState(k); s == "Z" {
				return true
			}
		}
		return false
	})
	st, err := sigstop(pid, kids...)
	if err != nil {
		t.Fatalf("a child that exited failed the pause: %v", err)
	}
	if err := st.cont(); err != nil {
		t.Fatal(err)
	}
}
