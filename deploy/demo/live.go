package main

import (
	"bufio"
	"context"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"io"
	"io/fs"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"

	"github.com/outbox-inbox/reference/pkg/outbox/outboxaudit"
)

// The live view is a web page the demo serves: the pipeline's counts, the
// processes' states, one order's journey, and buttons that inject the guided
// scenario's faults. Its data comes from outside the services, as an
// operator would read it: the processes' /readyz and /metrics, the orders and
// shipping HTTP APIs, the broker (broker.go), the shipping service's log
// (one debug line per settled delivery), the loss audit's last report
// (liveaudit.go), and read-only queries on the two
// stores for the counts that must be exact whatever restarts (the orders and
// their outbox rows in PostgreSQL, as `orders outbox-status` reads them; the
// applied effects in MongoDB). The faults are the demo's own: they stop,
// start and arm the processes it supervises and call rabbitmqctl; no service
// exposes them. So that no other web page can press them (a POST from a page
// the user visits elsewhere, sent by the browser), every request goes through
// net/http's cross-origin protection: a browser's cross-origin POST is
// refused with 403 before it reaches a handler.

//go:embed web
var webFiles embed.FS

// The broker queues of the shipping service (docs/events.md).
const (
	mainQueue  = "shipping.order-events"
	delayQueue = "shipping.order-events.delay"
	dlq        = "shipping.order-events.dlq"
)

// liveView serves the page and keeps the latest snapshot.
type liveView struct {
	d      *demo
	ctl    processController
	ln     net.Listener
	srv    *http.Server
	tr     *http.Transport
	client *http.Client
	pool   *pgxpool.Pool
	mongo  *mongo.Client
	broker *brokerReader
	page   *template.Template
	cancel context.CancelFunc
	done   chan struct{}

	mu    sync.Mutex
	snap  snapshot
	notes []note
	last  map[string]procStatus
}

// note is one line of the page's "what happened" list.
type note struct {
	At   time.Time `json:"at"`
	Text string    `json:"text"`
}

// parsePage parses the page's template.
func parsePage() (*template.Template, error) {
	return template.ParseFS(webFiles, "web/live.html")
}

func startLiveView(ctx context.Context, d *demo) (*liveView, error) {
	tmpl, err := parsePage()
	if err != nil {
		return nil, fmt.Errorf("live view: %w", err)
	}
	pcfg, err := pgxpool.ParseConfig(d.cfg.DatabaseURL)
	if err != nil {
		return nil, fmt.Errorf("live view: DATABASE_URL: %w", err)
	}
	pcfg.MaxConns = 3
	pcfg.ConnConfig.RuntimeParams["application_name"] = "demo live view"
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, fmt.Errorf("live view: %w", err)
	}
	mc, err := mongo.Connect(options.Client().ApplyURI(d.cfg.MongoURI).
		SetServerSelectionTimeout(2 * time.Second).SetConnectTimeout(2 * time.Second))
	if err != nil {
		pool.Close()
		return nil, fmt.Errorf("live view: MONGO_URI: %w", err)
	}
	ln, err := net.Listen("tcp", d.cfg.UIAddr)
	if err != nil {
		pool.Close()
		_ = mc.Disconnect(context.Background())
		return nil, fmt.Errorf("live view: listen on %s: %w", d.cfg.UIAddr, err)
	}
	tr := &http.Transport{MaxIdleConnsPerHost: 4, IdleConnTimeout: 30 * time.Second}
	v := &liveView{
		d: d, ctl: d.ctl, ln: ln, tr: tr, client: &http.Client{Transport: tr, Timeout: 5 * time.Second},
		pool: pool, mongo: mc, broker: newBrokerReader(d.cfg.AMQPURL), page: tmpl, done: make(chan struct{}), last: map[string]procStatus{},
	}
	v.srv = &http.Server{Handler: v.routes(), ReadHeaderTimeout: 5 * time.Second}
	cctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	v.cancel = cancel
	go v.collectLoop(cctx)
	go func() { _ = v.srv.Serve(ln) }()
	v.addNote("the demo started; this page reads the system every second")
	return v, nil
}

// close stops the page and releases its connections.
func (v *liveView) close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := v.srv.Shutdown(ctx)
	if errors.Is(err, context.DeadlineExceeded) {
		err = v.srv.Close()
	}
	v.cancel()
	<-v.done
	v.broker.close()
	v.pool.Close()
	_ = v.mongo.Disconnect(ctx)
	v.tr.CloseIdleConnections()
	if err != nil {
		return fmt.Errorf("live view: %w", err)
	}
	return nil
}

func (v *liveView) addNote(format string, args ...any) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.notes = append(v.notes, note{At: time.Now(), Text: fmt.Sprintf(format, args...)})
	if len(v.notes) > 30 {
		v.notes = v.notes[len(v.notes)-30:]
	}
}

func (v *liveView) routes() http.Handler {
	cross := http.NewCrossOriginProtection()
	cross.SetDenyHandler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		v.d.say("live view: refused a cross-origin %s %s (Origin %q, Sec-Fetch-Site %q)",
			r.Method, r.URL.Path, r.Header.Get("Origin"), r.Header.Get("Sec-Fetch-Site"))
		writeError(w, http.StatusForbidden, "cross_origin",
			"refused: a cross-origin request; only the live view's own page may press its buttons")
	}))
	mux := http.NewServeMux()
	static, _ := fs.Sub(webFiles, "web")
	mux.HandleFunc("GET /{$}", v.servePage)
	mux.Handle("GET /static/", http.StripPrefix("/static/", http.FileServerFS(static)))
	mux.HandleFunc("GET /api/state", v.serveState)
	mux.HandleFunc("GET /api/journey", v.serveJourney)
	mux.HandleFunc("POST /api/actions/{name}", v.serveAction)
	mux.HandleFunc("/api/actions/{name}", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Allow", http.MethodPost)
		writeError(w, http.StatusMethodNotAllowed, "method_not_allowed", "actions are POST")
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, "not_found", "no such page: "+r.URL.Path)
	})
	return cross.Handler(mux)
}

// writeError answers {"error": {"code", "message"}}, as the services do.
func writeError(w http.ResponseWriter, status int, code, msg string) {
	writeJSON(w, status, map[string]any{"error": map[string]string{"code": code, "message": msg}})
}

func writeJSON(w http.ResponseWriter, status int, body any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(body)
}

// pageData is what the page's template shows before its script runs.
type pageData struct {
	Actions   []action
	Processes []processInfo
	Where     []whereItem
}

type processInfo struct {
	Name, Role string
	Stoppable  bool
}

type whereItem struct{ What, Addr string }

func (v *liveView) servePage(w http.ResponseWriter, _ *http.Request) {
	data := pageData{Actions: v.actions(), Processes: v.ctl.processes()}
	c := v.d.cfg
	data.Where = []whereItem{{"processes", v.ctl.mode()}, {"orders API", "http://" + c.OrdersAddr}, {"shipping API", "http://" + c.ShippingAddr}}
	if c.RelayAddr != "" {
		data.Where = append(data.Where, whereItem{"relay-1 (metrics, readyz)", "http://" + c.RelayAddr}, whereItem{"relay-2 (metrics, readyz)", "http://" + c.Relay2Addr})
	}
	data.Where = append(data.Where, whereItem{"PostgreSQL", redacted(c.DatabaseURL)}, whereItem{"RabbitMQ", redacted(c.AMQPURL)}, whereItem{"MongoDB", redacted(c.MongoURI)})
	if c.JaegerUI != "" {
		data.Where = append(data.Where, whereItem{"Jaeger (traces)", c.JaegerUI})
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	if err := v.page.Execute(w, data); err != nil {
		v.d.say("live view: render the page: %v", err)
	}
}

var roles = map[string]string{
	"mongolocal": "MongoDB (embedded FerretDB): the inbox and the shipments",
	"shipping":   "consumes the queue; the inbox applies each event once",
	"orders":     "orders API: writes each order and its event in one transaction",
	"relay-1":    "relay: publishes committed outbox rows, marks them once confirmed",
	"relay-2":    "relay: a second one, sharing the work",
	"audit":      "loss audit: compares the outbox with shipping's inbox, again and again (cmd/audit -every)",
	"loadgen":    "load generator",
	// docker compose's services (compose.go)
	"postgres": "PostgreSQL: the orders and their outbox",
	"rabbitmq": "RabbitMQ: the exchange and shipping's queues",
	"mongodb":  "MongoDB (single-node replica set): the inbox and the shipments",
	"relay":    "relay: publishes committed outbox rows, marks them once confirmed (every replica)",
}

// canArm says whether the controller arms crash points (only the local
// supervisor starts the processes, with their environment).
func (v *liveView) canArm() bool {
	_, local := v.ctl.(*localController)
	return local
}

// actions are the page's buttons this controller can do.
func (v *liveView) actions() []action {
	var out []action
	for _, a := range actions {
		if a.crash && !v.canArm() {
			continue
		}
		if _, compose := v.ctl.(*composeController); compose && a.composeWhat != "" {
			a.What = a.composeWhat
		}
		out = append(out, a)
	}
	return out
}

// snapshot is what /api/state answers.
type snapshot struct {
	// At is when the sources were read; AgeSeconds how long before the
	// answer that was (the page marks old numbers as stale).
	At         time.Time     `json:"at"`
	AgeSeconds float64       `json:"age_seconds"`
	Stages     stages        `json:"stages"`
	Processes  []processView `json:"processes"`
	// Audit is the loss audit's last result; nil when there is none to show
	// (Errors["audit"] says why, unless the demo runs no audit).
	Audit  *auditResult      `json:"audit"`
	Errors map[string]string `json:"errors"`
	Notes  []note            `json:"notes"`
}

// stages are the pipeline's counts; a nil field could not be read (the page
// says "unknown", never 0).
type stages struct {
	OrdersCreated     *int64   `json:"orders_created"`
	EventsWritten     *int64   `json:"events_written"`
	Pending           *int64   `json:"pending"`
	OldestPendingAge  *float64 `json:"oldest_pending_age_seconds"`
	OutboxDeadLetters *int64   `json:"outbox_dead_letters"`
	Published         *int64   `json:"published"`
	Discarded         *int64   `json:"discarded"`
	QueueReady        *int64   `json:"queue_ready"`
	QueueConsumers    *int64   `json:"queue_consumers"`
	DelayQueue        *int64   `json:"delay_queue"`
	DeadLetterQueue   *int64   `json:"dead_letter_queue"`
	Applied           *int64   `json:"applied"`
	ShippingDead      *int64   `json:"shipping_dead_letters"`
	ParkedAggregates  *int64   `json:"parked_aggregates"`
	deliveryCounts
}

// processView is a process as the page shows it.
type processView struct {
	procStatus
	Role      string `json:"role"`
	Ready     *bool  `json:"ready,omitempty"`
	Detail    string `json:"detail,omitempty"`
	Published *int64 `json:"published,omitempty"` // relays: confirmed since this incarnation started
	Stoppable bool   `json:"stoppable"`
}

func (v *liveView) serveState(w http.ResponseWriter, _ *http.Request) {
	v.mu.Lock()
	s := v.snap
	s.Notes = append([]note(nil), v.notes...)
	v.mu.Unlock()
	if s.At.IsZero() {
		writeError(w, http.StatusServiceUnavailable, "first_reading", "the live view is reading the system for the first time")
		return
	}
	s.AgeSeconds = time.Since(s.At).Seconds()
	writeJSON(w, http.StatusOK, s)
}

func (v *liveView) collectLoop(ctx context.Context) {
	defer close(v.done)
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		s := v.collect(ctx)
		v.mu.Lock()
		v.snap = s
		v.mu.Unlock()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// collectTimeout bounds one reading of every source: a source that has not
// answered by then is reported as unreadable, and the others are shown.
const collectTimeout = 3 * time.Second

// collect reads everything once, the sources in parallel.
func (v *liveView) collect(ctx context.Context) snapshot {
	ctx, cancel := context.WithTimeout(ctx, collectTimeout)
	defer cancel()
	s := snapshot{At: time.Now(), Errors: map[string]string{}}
	s.Stages.deliveryCounts = v.d.deliveries.counts()
	var mu sync.Mutex
	fail := func(source string, err error) {
		mu.Lock()
		defer mu.Unlock()
		s.Errors[source] = err.Error()
	}
	var wg sync.WaitGroup
	wg.Go(func() {
		if err := v.readPostgres(ctx, &s.Stages); err != nil {
			fail("postgres", err)
		}
	})
	wg.Go(func() {
		n, err := v.mongo.Database(mongoDatabase(v.d.cfg.MongoURI)).Collection("shipment_events").CountDocuments(ctx, bson.D{})
		if err != nil {
			fail("mongodb", err)
			return
		}
		s.Stages.Applied = &n
	})
	wg.Go(func() {
		q, err := v.broker.counts(ctx)
		s.Stages.QueueReady, s.Stages.QueueConsumers, s.Stages.DelayQueue, s.Stages.DeadLetterQueue = q.Ready, q.Consumers, q.Delay, q.DeadLetters
		if err != nil {
			fail("broker", err)
		}
	})
	wg.Go(func() {
		m, err := v.scrape(ctx, "http://"+v.d.cfg.ShippingAddr+"/metrics")
		if err != nil {
			fail("shipping metrics", err)
			return
		}
		s.Stages.ShippingDead = m.int("shipping_dead_letters")
		s.Stages.ParkedAggregates = m.int("shipping_parked_aggregates")
	})
	if v.d.cfg.AuditAddr != "" {
		wg.Go(func() {
			r, err := v.readAudit(ctx, "http://"+v.d.cfg.AuditAddr+"/report")
			if err != nil {
				fail("audit", err)
				return
			}
			s.Audit = r
		})
	}
	infos := v.ctl.processes()
	statuses := v.ctl.statuses(ctx)
	procs := make([]processView, len(statuses))
	for i, st := range statuses {
		pv := processView{procStatus: st}
		if i < len(infos) {
			pv.Role, pv.Stoppable = infos[i].Role, infos[i].Stoppable
		}
		if st.Health != "" && st.State == procRunning {
			// Compose: the container's healthcheck, which probes /readyz
			// inside it (the relay publishes no port).
			ready := st.Health == "healthy"
			pv.Ready = &ready
			if !ready {
				pv.Detail = "healthcheck: " + st.Health
			}
		}
		procs[i] = pv
		addr := v.httpAddr(st.Name)
		if addr == "" || pv.State != procRunning {
			continue
		}
		wg.Go(func() {
			ready, detail := v.probe(ctx, "http://"+addr+"/readyz")
			procs[i].Ready, procs[i].Detail = &ready, detail
			if strings.HasPrefix(st.Name, "relay") {
				if m, err := v.scrape(ctx, "http://"+addr+"/metrics"); err == nil {
					procs[i].Published = m.int("outbox_published_total")
				}
			}
		})
	}
	wg.Wait()
	s.Processes = procs
	v.noteTransitions(procs)
	return s
}

// noteTransitions adds a note when a process changed state or pid.
func (v *liveView) noteTransitions(procs []processView) {
	for _, p := range procs {
		v.mu.Lock()
		prev, seen := v.last[p.Name]
		v.last[p.Name] = p.procStatus
		v.mu.Unlock()
		if !seen || (prev.State == p.State && prev.PID == p.PID) {
			continue
		}
		switch p.State {
		case procRestarting:
			v.addNote("%s died (%s): the demo restarts it", p.Name, p.LastExit)
		case procStopped:
			v.addNote("%s is stopped", p.Name)
		case procExited:
			v.addNote("%s exited (%s)", p.Name, p.LastExit)
		case procRunning:
			if p.Armed != "" {
				v.addNote("%s is running (pid %d), armed: %s", p.Name, p.PID, p.Armed)
			} else {
				v.addNote("%s is running again (pid %d)", p.Name, p.PID)
			}
		}
	}
}

func (v *liveView) httpAddr(name string) string {
	switch name {
	case "orders":
		return v.d.cfg.OrdersAddr
	case "shipping":
		return v.d.cfg.ShippingAddr
	case "relay-1":
		return v.d.cfg.RelayAddr
	case "relay-2":
		return v.d.cfg.Relay2Addr
	}
	return ""
}

// readPostgres reads the stages' database side: the orders written (the
// orders service's table, counted here for the demo's display) and the
// outbox's events by state (pkg/outbox's EventLog.Counts, exact).
func (v *liveView) readPostgres(ctx context.Context, st *stages) error {
	var orders int64
	if err := v.pool.QueryRow(ctx, "SELECT count(*) FROM orders").Scan(&orders); err != nil {
		return err
	}
	log, err := outboxaudit.NewEventLog(v.pool, 0)
	if err != nil {
		return err
	}
	c, err := log.Counts(ctx)
	if err != nil {
		return err
	}
	pending, dead, published, discarded := c.Pending, c.DeadLettered, c.Published, c.Discarded
	age := c.OldestPendingAge.Seconds()
	written := pending + dead + published + discarded
	st.OrdersCreated, st.Pending, st.OutboxDeadLetters = &orders, &pending, &dead
	st.OldestPendingAge, st.Published, st.Discarded, st.EventsWritten = &age, &published, &discarded, &written
	return nil
}

// probe GETs a /readyz: ready on 2xx; otherwise the body says why.
func (v *liveView) probe(ctx context.Context, url string) (bool, string) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return false, err.Error()
	}
	resp, err := v.client.Do(req)
	if err != nil {
		return false, "not answering"
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode/100 == 2 {
		return true, ""
	}
	return false, notReadyReason(body)
}

// notReadyReason shortens a /readyz body to what is down.
func notReadyReason(body []byte) string {
	var m map[string]any
	if json.Unmarshal(body, &m) != nil {
		return strings.TrimSpace(string(body))
	}
	if checks, ok := m["checks"].(map[string]any); ok {
		m = checks
	}
	var down []string
	for _, k := range []string{"database", "broker", "mongodb"} {
		if s, ok := m[k].(string); ok && s != "ok" {
			down = append(down, k+": "+s)
		}
	}
	if len(down) == 0 {
		return strings.TrimSpace(string(body))
	}
	return strings.Join(down, "; ")
}

// metricsText is a scraped Prometheus text exposition: name{labels} -> value.
type metricsText map[string]float64

func (m metricsText) int(name string) *int64 {
	f, ok := m[name]
	if !ok {
		return nil
	}
	n := int64(f)
	return &n
}

func (v *liveView) scrape(ctx context.Context, url string) (metricsText, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := v.client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return parseMetrics(resp.Body)
}

func parseMetrics(r io.Reader) (metricsText, error) {
	m := metricsText{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			continue
		}
		f, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			continue
		}
		m[line[:i]] = f
	}
	return m, sc.Err()
}

// mongoDatabase is the database of a mongodb:// URI (default "shipping", as
// the shipping service has it).
func mongoDatabase(uri string) string {
	cs := strings.TrimPrefix(uri, "mongodb://")
	if i := strings.IndexByte(cs, '/'); i >= 0 {
		db := cs[i+1:]
		if j := strings.IndexByte(db, '?'); j >= 0 {
			db = db[:j]
		}
		if db != "" {
			return db
		}
	}
	return "shipping"
}
