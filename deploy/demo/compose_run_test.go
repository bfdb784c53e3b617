package main

import (
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// fakeDocker is a `docker` executable for TestComposeModeServesTheLiveView:
// it appends its command line to $FAKE_DOCKER_LOG and answers `compose -f
// FILE port|ps|logs` from the environment; every other command succeeds
// silently.
const fakeDocker = `#!/bin/sh
echo "docker $*" >> "$FAKE_DOCKER_LOG"
[ "$1 $2" = "compose -f" ] || exit 3
shift 3
case "$1" in
port)
	case "$2 $3" in
	"orders 8080") echo "$FAKE_ORDERS" ;;
	"shipping 8081") echo "$FAKE_SHIPPING" ;;
	"postgres 5432" | "rabbitmq 5672" | "mongodb 27017") echo "$FAKE_CLOSED" ;;
	"jaeger 16686") echo "0.0.0.0:16686" ;;
	*) exit 1 ;;
	esac ;;
ps) cat "$FAKE_PS" ;;
logs)
	echo '{"time":"2026-12-01T08:00:00Z","level":"DEBUG","msg":"applied","service":"shipping","event_id":"7"}'
	echo '{"time":"2026-12-01T08:00:01Z","level":"INFO","msg":"consumer started","service":"shipping"}'
	exec sleep 600 ;;
esac
`

// The compose mode end to end, with a fake docker on PATH instead of an
// engine: bin/demo -compose reads the published ports, serves the page with
// the compose services as its process cards (states and healthchecks from
// `docker compose ps`), counts shipping's deliveries from `docker compose
// logs`, runs `docker compose stop relay` for "Stop both relays", and stops
// the project on exit. The stores are on a closed port: the page reports
// them unreadable, which is all this test needs of them.
func TestComposeModeServesTheLiveView(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "docker"), []byte(fakeDocker), 0o755); err != nil {
		t.Fatal(err)
	}
	logPath, psPath := filepath.Join(dir, "docker.log"), filepath.Join(dir, "ps.json")
	ps := `{"Name":"p-orders-1","Service":"orders","State":"running","Health":"healthy","Status":"Up","ExitCode":0}
{"Name":"p-relay-1","Service":"relay","State":"running","Health":"unhealthy","Status":"Up (unhealthy)","ExitCode":0}
{"Name":"p-shipping-1","Service":"shipping","State":"exited","Status":"Exited (137)","ExitCode":137}
`
	if err := os.WriteFile(psPath, []byte(ps), 0o644); err != nil {
		t.Fatal(err)
	}
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/readyz" {
			_, _ = w.Write([]byte(`{"status":"ok"}`))
			return
		}
		http.NotFound(w, r)
	}))
	t.Cleanup(api.Close)
	closed := freeTestAddr(t)
	ui := freeTestAddr(t)
	composeFile := filepath.Join(dir, "docker-compose.yml")
	if err := os.WriteFile(composeFile, []byte("services: {}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", dir+string(os.PathListSeparator)+os.Getenv("PATH"))
	t.Setenv("FAKE_DOCKER_LOG", logPath)
	t.Setenv("FAKE_PS", psPath)
	t.Setenv("FAKE_ORDERS", strings.TrimPrefix(api.URL, "http://"))
	t.Setenv("FAKE_SHIPPING", strings.TrimPrefix(api.URL, "http://"))
	t.Setenv("FAKE_CLOSED", closed)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	out := &syncBuffer{}
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"-compose", composeFile, "-ui-addr", ui}, func(string) string { return "" }, out)
	}()

	base := "http://" + ui
	var st snapshot
	eventually(t, "the page shows the compose services and one delivery", func() bool {
		resp, err := http.Get(base + "/api/state")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		st = snapshot{}
		if json.NewDecoder(resp.Body).Decode(&st) != nil || len(st.Processes) != len(composeProcesses) {
			return false
		}
		return st.Stages.Delivered == 1 && st.Processes[3].Ready != nil
	}, done)
	byName := map[string]processView{}
	for _, p := range st.Processes {
		byName[p.Name] = p
	}
	if p := byName["orders"]; p.State != procRunning || p.Ready == nil || !*p.Ready {
		t.Errorf("orders card: %+v, want up and ready (its /readyz answers)", p)
	}
	if p := byName["relay"]; p.State != procRunning || p.Ready == nil || *p.Ready || p.Detail != "healthcheck: unhealthy" || !p.Stoppable {
		t.Errorf("relay card: %+v, want up, not ready from its healthcheck, stoppable", p)
	}
	if p := byName["shipping"]; p.State != procExited || p.LastExit != "Exited (137)" {
		t.Errorf("shipping card: %+v, want down with its exit", p)
	}
	if p := byName["mongodb"]; p.State != procExited || p.LastExit != "no container" {
		t.Errorf("mongodb card: %+v, want no container", p)
	}
	for _, src := range []string{"postgres", "mongodb", "broker"} {
		if st.Errors[src] == "" {
			t.Errorf("reading %s from a closed port: no error shown (errors: %v)", src, st.Errors)
		}
	}
	if strings.Contains(out.String(), `"DEBUG"`) || !strings.Contains(out.String(), "consumer started") {
		t.Errorf("terminal: want shipping's info lines and not its debug lines:\n%s", out)
	}

	page, err := http.Get(base + "/")
	if err != nil {
		t.Fatal(err)
	}
	body := new(strings.Builder)
	_, _ = io.Copy(body, page.Body)
	_ = page.Body.Close()
	for _, want := range []string{`id="proc-relay"`, `data-action="stop-relays"`, "docker compose (" + composeFile + ")", "Jaeger (traces): <code>http://127.0.0.1:16686</code>"} {
		if !strings.Contains(body.String(), want) {
			t.Errorf("the page lacks %s", want)
		}
	}
	if strings.Contains(body.String(), `data-action="crash-relay"`) {
		t.Error("the page offers a crash button under compose")
	}

	resp, err := http.Post(base+"/api/actions/stop-relays", "", nil)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("stop-relays: %s", resp.Status)
	}

	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("run: %v", err)
		}
	case <-time.After(2 * time.Minute):
		t.Fatal("the compose mode did not return after its context ended")
	}
	raw, err := os.ReadFile(logPath)
	if err != nil {
		t.Fatal(err)
	}
	dc := "docker compose -f " + composeFile + " "
	log := string(raw)
	for _, want := range []string{
		dc + "port orders 8080\n", dc + "port shipping 8081\n", dc + "port postgres 5432\n",
		dc + "port rabbitmq 5672\n", dc + "port mongodb 27017\n", dc + "port jaeger 16686\n",
		dc + "ps --all --format json\n",
		dc + "logs --follow --no-color --no-log-prefix --since ",
		dc + "stop relay\n",
	} {
		if !strings.Contains(log, want) {
			t.Errorf("docker was not run as %q; it ran:\n%s", want, log)
		}
	}
	if !strings.HasSuffix(log, dc+"stop\n") {
		t.Errorf("the last command was not %q (the project stopped on exit); ran:\n%s", dc+"stop", log)
	}
}

func freeTestAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	return addr
}

// eventually polls cond (generously: the machine may be slow) and fails
// early if the demo returned.
func eventually(t *testing.T, what string, cond func() bool, done <-chan error) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for !cond() {
		select {
		case err := <-done:
			t.Fatalf("waiting for %s: the demo returned: %v", what, err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
