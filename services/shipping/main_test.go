package main

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/outbox-inbox/reference/internal/mongolocal/mongotest"
	"github.com/outbox-inbox/reference/services/shipping/internal/amqptest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(mongotest.Suite(m)) }

func env(m map[string]string) func(string) string { return func(k string) string { return m[k] } }

func TestRunServesUntilCancelled(t *testing.T) {
	_, amqpURL := amqptest.VHost(t)
	uri, db := mongotest.ForTest(t)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	pr, pw := io.Pipe()
	errc := make(chan error, 1)
	go func() {
		err := run(ctx, []string{"-delay", "200ms"}, env(map[string]string{
			"AMQP_URL": amqpURL, "MONGO_URI": uri + db, "HTTP_ADDR": "127.0.0.1:0", "LOG_LEVEL": "debug",
		}), pw)
		pw.Close()
		errc <- err
	}()

	lines := bufio.NewScanner(pr)
	var addr string
	for addr == "" && lines.Scan() {
		var rec struct {
			Msg      string `json:"msg"`
			HTTPAddr string `json:"http_addr"`
		}
		if json.Unmarshal(lines.Bytes(), &rec) == nil && rec.Msg == "listening" {
			addr = rec.HTTPAddr
		}
	}
	if addr == "" {
		t.Fatalf("no listening line (run: %v)", <-errc)
	}
	go func() { _, _ = io.Copy(io.Discard, pr) }()

	resp, err := http.Get("http://" + addr + "/healthz")
	if err != nil {
		t.Fatalf("healthz: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("healthz %d", resp.StatusCode)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get("http://" + addr + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("never ready")
		}
		time.Sleep(50 * time.Millisecond)
	}

	cancel() // SIGTERM
	select {
	case err := <-errc:
		if err != nil {
			t.Fatalf("run returned %v on cancel, want nil", err)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("run did not return 60s after cancel")
	}
}

func TestRunRejectsBadInput(t *testing.T) {
	for name, tc := range map[string]struct {
		args []string
		env  map[string]string
	}{
		"unknown flag":                  {args: []string{"-nope"}},
		"extra argument":                {args: []string{"serve"}},
		"bad log level":                 {env: map[string]string{"LOG_LEVEL": "loud"}},
		"bad crash":                     {env: map[string]string{"CRASH_POINT": "shipping.nowhere"}},
		"bad mongo uri":                 {env: map[string]string{"MONGO_URI": "mysql://x"}},
		"bad http addr":                 {env: map[string]string{"HTTP_ADDR": "nowhere"}},
		"bad delay":                     {args: []string{"-delay", "1us"}},
		"bad inbox flush interval":      {env: map[string]string{"INBOX_FLUSH_INTERVAL": "soon"}},
		"negative inbox flush interval": {env: map[string]string{"INBOX_FLUSH_INTERVAL": "-1ms"}},
	} {
		t.Run(name, func(t *testing.T) {
			err := run(t.Context(), tc.args, env(tc.env), io.Discard)
			if err == nil {
				t.Fatal("run succeeded, want an error")
			}
			if v, ok := tc.env["INBOX_FLUSH_INTERVAL"]; ok && !strings.Contains(err.Error(), "INBOX_FLUSH_INTERVAL") {
				t.Fatalf("INBOX_FLUSH_INTERVAL=%q: error %q does not name the variable", v, err)
			}
		})
	}
}
