package chaos

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"
)

// WorkloadConfig configures a Workload.
type WorkloadConfig struct {
	// BaseURL is the orders API, e.g. "http://127.0.0.1:8080". Required.
	BaseURL string
	// Recorder receives every finished operation. Required.
	Recorder *Recorder
	// KeyPrefix starts every Idempotency-Key, so keys of different runs never
	// meet. Required; at most 64 bytes of [A-Za-z0-9_-].
	KeyPrefix string
	// Clients is the number of concurrent clients. Default: 4.
	Clients int
	// Rate bounds the creates per second over all clients. Default: 20.
	Rate float64
	// CancelRatio is the share of acknowledged orders a client cancels, half
	// at once (so create and cancel travel together), half a few operations
	// later. Default: 0.
	CancelRatio float64
	// AmendRatio is the share of acknowledged orders a client amends, right
	// after their create and before any cancel: AmendMin to AmendMax
	// amendments (a seeded number), each with a key of its own sent again on
	// every retry, so such an order reaches AmendMin+2 to AmendMax+2
	// versions with its cancel. Default: 0.
	AmendRatio float64
	// AmendMin and AmendMax bound an amended order's amendments. Default: 4
	// and 18 (orders of 5 to 20 versions).
	AmendMin, AmendMax int
	// Seed makes each client's choices reproducible (not their timing).
	Seed int64
	// AttemptTimeout bounds one HTTP attempt. Default: 3s.
	AttemptTimeout time.Duration
	// OpTimeout bounds an operation with its retries; an operation still
	// without an answer then ends with OutcomeUnknown. Default: 45s.
	OpTimeout time.Duration
	// Client sends the requests. Default: a client of its own, whose idle
	// connections Run closes when it returns.
	Client *http.Client
	// Logger. Default: discard.
	Logger *slog.Logger
}

// Workload is a set of concurrent clients creating, amending and cancelling
// orders through the orders API, retrying with the same Idempotency-Key until they
// get an answer, and recording each operation's outcome.
type Workload struct {
	cfg      WorkloadConfig
	client   *http.Client
	ownTrans *http.Transport
	logger   *slog.Logger
}

// NewWorkload validates cfg and returns a Workload.
func NewWorkload(cfg WorkloadConfig) (*Workload, error) {
	cfg.Clients = cmp.Or(cfg.Clients, 4)
	cfg.Rate = cmp.Or(cfg.Rate, 20)
	cfg.AttemptTimeout = cmp.Or(cfg.AttemptTimeout, 3*time.Second)
	cfg.OpTimeout = cmp.Or(cfg.OpTimeout, 45*time.Second)
	cfg.AmendMin = cmp.Or(cfg.AmendMin, 4)
	cfg.AmendMax = cmp.Or(cfg.AmendMax, 18)
	switch {
	case !strings.HasPrefix(cfg.BaseURL, "http://") && !strings.HasPrefix(cfg.BaseURL, "https://"):
		return nil, fmt.Errorf("workload: BaseURL %q: want an http:// or https:// URL", cfg.BaseURL)
	case cfg.Recorder == nil:
		return nil, errors.New("workload: Recorder is required")
	case !validKeyPrefix(cfg.KeyPrefix):
		return nil, fmt.Errorf("workload: KeyPrefix %q: want 1 to 64 bytes of [A-Za-z0-9_-]", cfg.KeyPrefix)
	case cfg.Clients < 1 || cfg.Rate < 0 || cfg.CancelRatio < 0 || cfg.CancelRatio > 1:
		return nil, fmt.Errorf("workload: want Clients >= 1, Rate > 0, CancelRatio in [0, 1]; got %d, %v, %v", cfg.Clients, cfg.Rate, cfg.CancelRatio)
	case cfg.AmendRatio < 0 || cfg.AmendRatio > 1 || cfg.AmendMin < 1 || cfg.AmendMax < cfg.AmendMin:
		return nil, fmt.Errorf("workload: want AmendRatio in [0, 1], 1 <= AmendMin <= AmendMax; got %v, %d, %d", cfg.AmendRatio, cfg.AmendMin, cfg.AmendMax)
	case cfg.AttemptTimeout < 0 || cfg.OpTimeout < cfg.AttemptTimeout:
		return nil, fmt.Errorf("workload: want 0 < AttemptTimeout <= OpTimeout; got %v, %v", cfg.AttemptTimeout, cfg.OpTimeout)
	}
	w := &Workload{cfg: cfg, client: cfg.Client, logger: cfg.Logger}
	w.cfg.BaseURL = strings.TrimRight(cfg.BaseURL, "/")
	if w.client == nil {
		w.ownTrans = &http.Transport{MaxIdleConnsPerHost: cfg.Clients, IdleConnTimeout: 30 * time.Second}
		w.client = &http.Client{Transport: w.ownTrans}
	}
	if w.logger == nil {
		w.logger = slog.New(slog.DiscardHandler)
	}
	return w, nil
}

func validKeyPrefix(s string) bool {
	if len(s) == 0 || len(s) > 64 {
		return false
	}
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_') {
			return false
		}
	}
	return true
}

// Run starts the clients and returns when ctx ends and every operation in
// flight has finished (each within OpTimeout). It returns nil: outcomes,
// failures included, go to the Recorder.
func (w *Workload) Run(ctx context.Context) error {
	var wg sync.WaitGroup
	for i := range w.cfg.Clients {
		wg.Go(func() { w.client1(ctx, i+1) })
	}
	wg.Wait()
	if w.ownTrans != nil {
		w.ownTrans.CloseIdleConnections()
	}
	return nil
}

// client1 is one client: it creates an order every Clients/Rate seconds, and
// cancels some of the orders it created.
func (w *Workload) client1(ctx context.Context, id int) {
	rng := rand.New(rand.NewPCG(uint64(w.cfg.Seed), uint64(id)))
	period := time.Duration(float64(time.Second) * float64(w.cfg.Clients) / w.cfg.Rate)
	type deferred struct {
		orderID string
		due     int
	}
	var later []deferred
	next := time.Now().Add(time.Duration(rng.Int64N(int64(period) + 1)))
	for n := 1; ; n++ {
		t := time.NewTimer(time.Until(next))
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		next = next.Add(period)
		if now := time.Now(); next.Before(now) {
			next = now // a slow operation does not cause a burst after it
		}
		// Operations outlive ctx by up to OpTimeout: the client keeps retrying
		// what it started, as a real one would, so few outcomes stay unknown.
		opCtx := context.WithoutCancel(ctx)

		key := fmt.Sprintf("%s-c%d-%d", w.cfg.KeyPrefix, id, n)
		op := w.create(opCtx, key, rng)
		if op.Outcome == OutcomeOK && rng.Float64() < w.cfg.AmendRatio {
			// Back to back, so that the relay finds runs of one order's
			// events in its batches. An amendment whose outcome stays
			// unknown does not stop the chain: the checker reads versions
			// from what committed.
			for i := range w.cfg.AmendMin + rng.IntN(w.cfg.AmendMax-w.cfg.AmendMin+1) {
				w.amend(opCtx, op.OrderID, fmt.Sprintf("%s-a%d", key, i+1), rng)
			}
		}
		if op.Outcome == OutcomeOK && rng.Float64() < w.cfg.CancelRatio {
			if rng.IntN(2) == 0 {
				w.cancel(opCtx, op.OrderID)
			} else {
				later = append(later, deferred{op.OrderID, n + 1 + rng.IntN(10)})
			}
		}
		for len(later) > 0 && later[0].due <= n {
			w.cancel(opCtx, later[0].orderID)
			later = later[1:]
		}
	}
}

type createBody struct {
	CustomerID string       `json:"customer_id"`
	Currency   string       `json:"currency"`
	Items      []createItem `json:"items"`
}

type createItem struct {
	SKU       string `json:"sku"`
	Quantity  int64  `json:"quantity"`
	UnitPrice int64  `json:"unit_price"`
}

var currencies = []string{"EUR", "USD", "GBP", "CHF"}

func (w *Workload) create(ctx context.Context, key string, rng *rand.Rand) Op {
	body := createBody{CustomerID: key, Currency: currencies[rng.IntN(len(currencies))]}
	for i := range 1 + rng.IntN(3) {
		body.Items = append(body.Items, createItem{
			SKU: "sku-" + strconv.Itoa(i+1+rng.IntN(50)), Quantity: 1 + rng.Int64N(5), UnitPrice: 100 + rng.Int64N(100_000),
		})
	}
	b, _ := json.Marshal(body) // plain strings and integers always encode
	op := Op{Kind: OpCreate, Key: key}
	w.do(ctx, &op, http.MethodPost, "/orders", b, map[string]string{"Idempotency-Key": key}, http.StatusCreated)
	return op
}

func (w *Workload) cancel(ctx context.Context, orderID string) Op {
	op := Op{Kind: OpCancel, OrderID: orderID}
	w.do(ctx, &op, http.MethodPost, "/orders/"+orderID+"/cancel", nil, nil, http.StatusOK)
	return op
}

var noteWords = []string{"leave at the door", "ring twice", "call on arrival", "back entrance", "fragile", "after 6 pm"}

// amend sends an amendment with key as its Idempotency-Key and a note that
// names the key, so that its order.amended event names the operation.
func (w *Workload) amend(ctx context.Context, orderID, key string, rng *rand.Rand) Op {
	note := key + ": " + noteWords[rng.IntN(len(noteWords))]
	b, _ := json.Marshal(map[string]string{"note": note}) // a string always encodes
	op := Op{Kind: OpAmend, Key: key, OrderID: orderID, Note: note}
	w.do(ctx, &op, http.MethodPost, "/orders/"+orderID+"/amendments", b, map[string]string{"Idempotency-Key": key}, http.StatusCreated)
	return op
}

// do sends the request until it gets a definitive answer or OpTimeout passes,
// fills op's outcome and records it.
func (w *Workload) do(ctx context.Context, op *Op, method, path string, body []byte, header map[string]string, okStatus int) {
	ctx, cancel := context.WithTimeout(ctx, w.cfg.OpTimeout)
	defer cancel()
	op.Start = time.Now()
	backoff := 50 * time.Millisecond
	for {
		op.Attempts++
		status, ans, err := w.attempt(ctx, method, path, body, header)
		op.Status = status
		op.Err = ""
		if err != nil {
			op.Err = err.Error()
		}
		switch {
		case err == nil && status == okStatus:
			op.Outcome = OutcomeOK
			if op.OrderID == "" {
				op.OrderID = ans.id
			}
			if op.Kind == OpAmend {
				op.Version = ans.version
			}
		case status >= 400 && status < 500 && !retryableStatus(status):
			op.Outcome = OutcomeFailed
		}
		if op.Outcome != "" {
			break
		}
		// A transport error, a timeout, a 5xx or a 2xx we could not read:
		// the operation may or may not have happened, retry with the same key.
		sleep := backoff/2 + time.Duration(rand.Int64N(int64(backoff/2)+1))
		backoff = min(2*backoff, time.Second)
		t := time.NewTimer(sleep)
		select {
		case <-ctx.Done():
			t.Stop()
			op.Outcome = OutcomeUnknown
		case <-t.C:
		}
		if op.Outcome != "" {
			break
		}
	}
	op.End = time.Now()
	if op.Outcome != OutcomeOK {
		w.logger.Debug("workload operation not acknowledged", "kind", op.Kind, "key", op.Key, "aggregate_id", op.OrderID,
			"outcome", op.Outcome, "attempt", op.Attempts, "status", op.Status, "error", op.Err)
	}
	w.cfg.Recorder.Op(*op)
}

// retryableStatus: 4xx answers that say "try again" rather than "no".
func retryableStatus(status int) bool {
	return status == http.StatusRequestTimeout || status == http.StatusTooManyRequests || status == 499
}

// answer is what a 2xx body says: the order's id (an order's id, an
// amendment's order_id) and, for an amendment, its version.
type answer struct {
	id      string
	version int64
}

// attempt sends one request and returns the status and, for a 2xx, the order
// id (and version) in the body. err describes a transport failure or an
// error body.
func (w *Workload) attempt(ctx context.Context, method, path string, body []byte, header map[string]string) (int, answer, error) {
	ctx, cancel := context.WithTimeout(ctx, w.cfg.AttemptTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, w.cfg.BaseURL+path, bytes.NewReader(body))
	if err != nil {
		return 0, answer{}, fmt.Errorf("build request: %w", err)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := w.client.Do(req)
	if err != nil {
		return 0, answer{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return resp.StatusCode, answer{}, fmt.Errorf("read response: %w", err)
	}
	if resp.StatusCode >= 300 {
		return resp.StatusCode, answer{}, fmt.Errorf("HTTP %d: %s", resp.StatusCode, strings.TrimSpace(string(b)))
	}
	var o struct {
		ID      string `json:"id"`
		OrderID string `json:"order_id"`
		Version int64  `json:"version"`
	}
	if err := json.Unmarshal(b, &o); err != nil || cmp.Or(o.ID, o.OrderID) == "" {
		return resp.StatusCode, answer{}, fmt.Errorf("HTTP %d with an unreadable order %q", resp.StatusCode, b)
	}
	return resp.StatusCode, answer{cmp.Or(o.ID, o.OrderID), o.Version}, nil
}
