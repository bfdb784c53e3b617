package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// config is the load to generate.
type config struct {
	// URL is the orders API's base URL. Default: http://127.0.0.1:8080.
	URL string
	// Rate is orders per second. Default: 20.
	Rate float64
	// N stops after this many orders. Default: 0 (no limit but Duration).
	N int
	// Duration stops after this long. Default: 1m.
	Duration time.Duration
	// Cancel is the share of created orders that are then cancelled, in
	// [0, 1]. Default: 0.2.
	Cancel float64
	// Workers is the number of requests in flight at most. Default: 8.
	Workers int
	// Report is the interval of the progress line. Default: 5s; 0 turns it off.
	Report time.Duration
	// Timeout bounds each request. Default: 10s.
	Timeout time.Duration
}

func parseFlags(args []string, stderr io.Writer) (config, error) {
	var c config
	fs := flag.NewFlagSet("loadgen", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.URL, "url", "http://127.0.0.1:8080", "orders API base URL")
	fs.Float64Var(&c.Rate, "rate", 20, "orders per second")
	fs.IntVar(&c.N, "n", 0, "stop after this many orders (0: only -duration limits)")
	fs.DurationVar(&c.Duration, "duration", time.Minute, "stop after this long")
	fs.Float64Var(&c.Cancel, "cancel", 0.2, "share of created orders to cancel, 0 to 1")
	fs.IntVar(&c.Workers, "workers", 8, "requests in flight at most")
	fs.DurationVar(&c.Report, "report", 5*time.Second, "progress line interval (0: off)")
	fs.DurationVar(&c.Timeout, "timeout", 10*time.Second, "timeout of each request")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if fs.NArg() > 0 {
		return c, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	return c, c.validate()
}

func (c config) validate() error {
	u, err := url.Parse(c.URL)
	switch {
	case err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "":
		return fmt.Errorf("-url %q: want an http(s) base URL such as http://127.0.0.1:8080", c.URL)
	case !(c.Rate > 0 && c.Rate <= 10000):
		return fmt.Errorf("-rate %v: want more than 0 and at most 10000 orders per second", c.Rate)
	case c.N < 0:
		return fmt.Errorf("-n %d: want 0 (no limit) or a positive count", c.N)
	case c.Duration <= 0:
		return fmt.Errorf("-duration %v: want a positive duration; the load always stops by itself", c.Duration)
	case !(c.Cancel >= 0 && c.Cancel <= 1):
		return fmt.Errorf("-cancel %v: want a share between 0 and 1", c.Cancel)
	case c.Workers < 1 || c.Workers > 1000:
		return fmt.Errorf("-workers %d: want 1 to 1000", c.Workers)
	case c.Report < 0:
		return fmt.Errorf("-report %v: want 0 (off) or a positive interval", c.Report)
	case c.Timeout <= 0:
		return fmt.Errorf("-timeout %v: want a positive duration", c.Timeout)
	}
	return nil
}

// generator places and cancels orders.
type generator struct {
	cfg    config
	base   string
	runID  string
	client *http.Client
	out    io.Writer

	created, cancelled, failed atomic.Int64

	mu        sync.Mutex
	firstErrs []string
}

func newGenerator(cfg config, out io.Writer) (*generator, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	b := make([]byte, 4)
	if _, err := rand.Read(b); err != nil {
		return nil, fmt.Errorf("make run id: %w", err)
	}
	return &generator{
		cfg:    cfg,
		base:   strings.TrimRight(cfg.URL, "/"),
		runID:  hex.EncodeToString(b),
		client: &http.Client{Timeout: cfg.Timeout},
		out:    out,
	}, nil
}

// run generates the load until N orders, Duration, or ctx ends, then waits for
// the requests in flight. It returns an error if any request failed.
func (g *generator) run(ctx context.Context) error {
	start := time.Now()
	produceCtx, cancel := context.WithTimeout(ctx, g.cfg.Duration)
	defer cancel()

	jobs := make(chan int)
	var wg sync.WaitGroup
	for range g.cfg.Workers {
		wg.Go(func() {
			for i := range jobs {
				// A request in flight is finished even after an interrupt, so
				// the summary never counts an abandoned request as a failure.
				g.one(context.WithoutCancel(ctx), i)
			}
		})
	}

	stopReport := g.reportEvery(produceCtx, start)
	g.produce(produceCtx, jobs)
	close(jobs)
	wg.Wait()
	stopReport()

	elapsed := time.Since(start)
	created, cancelled, failed := g.created.Load(), g.cancelled.Load(), g.failed.Load()
	fmt.Fprintf(g.out, "loadgen: done in %s: %d orders created, %d cancelled, %d failed requests (%.1f orders/s)\n",
		elapsed.Round(100*time.Millisecond), created, cancelled, failed, float64(created)/elapsed.Seconds())
	if failed > 0 {
		g.mu.Lock()
		defer g.mu.Unlock()
		return fmt.Errorf("%d requests failed; first errors: %s", failed, strings.Join(g.firstErrs, "; "))
	}
	return nil
}

// produce hands out order numbers at the configured rate.
func (g *generator) produce(ctx context.Context, jobs chan<- int) {
	interval := time.Duration(float64(time.Second) / g.cfg.Rate)
	tick := time.NewTicker(max(interval, time.Microsecond))
	defer tick.Stop()
	for i := 1; g.cfg.N == 0 || i <= g.cfg.N; i++ {
		select {
		case jobs <- i:
		case <-ctx.Done():
			return
		}
		if g.cfg.N != 0 && i == g.cfg.N {
			return
		}
		select {
		case <-tick.C:
		case <-ctx.Done():
			return
		}
	}
}

func (g *generator) reportEvery(ctx context.Context, start time.Time) (stop func()) {
	if g.cfg.Report == 0 {
		return func() {}
	}
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		t := time.NewTicker(g.cfg.Report)
		defer t.Stop()
		for {
			select {
			case <-t.C:
				fmt.Fprintf(g.out, "loadgen: %s: %d orders created, %d cancelled, %d failed requests\n",
					time.Since(start).Round(time.Second), g.created.Load(), g.cancelled.Load(), g.failed.Load())
			case <-ctx.Done():
				return
			case <-done:
				return
			}
		}
	})
	return func() { close(done); wg.Wait() }
}

type item struct {
	SKU       string `json:"sku"`
	Quantity  int    `json:"quantity"`
	UnitPrice int64  `json:"unit_price"`
}

type newOrder struct {
	CustomerID string `json:"customer_id"`
	Currency   string `json:"currency"`
	Items      []item `json:"items"`
}

type orderReply struct {
	ID     string `json:"id"`
	Status string `json:"status"`
}

// one places order number i and, for a share of them, cancels it.
func (g *generator) one(ctx context.Context, i int) {
	body := newOrder{
		CustomerID: fmt.Sprintf("c-%d", mrand.IntN(1000)),
		Currency:   "EUR",
		Items:      []item{{SKU: fmt.Sprintf("sku-%d", mrand.IntN(50)), Quantity: 1 + mrand.IntN(3), UnitPrice: int64(100 * (1 + mrand.IntN(99)))}},
	}
	key := fmt.Sprintf("loadgen-%s-%d", g.runID, i)
	var o orderReply
	if err := g.post(ctx, "/orders", key, body, http.StatusCreated, &o); err != nil {
		g.fail(fmt.Errorf("create order %d: %w", i, err))
		return
	}
	if o.ID == "" {
		g.fail(fmt.Errorf("create order %d: reply has no id", i))
		return
	}
	g.created.Add(1)
	if mrand.Float64() >= g.cfg.Cancel {
		return
	}
	if err := g.post(ctx, "/orders/"+url.PathEscape(o.ID)+"/cancel", "", nil, http.StatusOK, &o); err != nil {
		g.fail(fmt.Errorf("cancel order %s: %w", o.ID, err))
		return
	}
	g.cancelled.Add(1)
}

func (g *generator) post(ctx context.Context, path, idemKey string, in any, want int, out any) error {
	var body io.Reader = http.NoBody
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return fmt.Errorf("encode body: %w", err)
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, g.base+path, body)
	if err != nil {
		return fmt.Errorf("build request: %w", err)
	}
	if in != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if idemKey != "" {
		req.Header.Set("Idempotency-Key", idemKey)
	}
	resp, err := g.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if err != nil {
		return fmt.Errorf("read reply: %w", err)
	}
	if resp.StatusCode != want {
		return fmt.Errorf("POST %s: %s: %s", path, resp.Status, bytes.TrimSpace(raw))
	}
	if err := json.Unmarshal(raw, out); err != nil {
		return fmt.Errorf("POST %s: decode reply: %w", path, err)
	}
	return nil
}

func (g *generator) fail(err error) {
	g.failed.Add(1)
	g.mu.Lock()
	defer g.mu.Unlock()
	if len(g.firstErrs) < 3 {
		g.firstErrs = append(g.firstErrs, err.Error())
	}
}
