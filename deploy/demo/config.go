package main

import (
	"cmp"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// config is what the demo runs and where.
type config struct {
	// BinDir holds the orders, shipping, mongolocal, audit and loadgen binaries.
	// Default: the directory of the demo binary itself.
	BinDir string
	// StateDir keeps the embedded MongoDB's data and the processes' pid
	// files across runs. Default: outbox-inbox/demo in the user cache
	// directory.
	StateDir string
	// DatabaseURL is DATABASE_URL. Default:
	// postgres://postgres@127.0.0.1:5432/orders_demo?sslmode=disable.
	DatabaseURL string
	// AMQPURL is AMQP_URL. Default: amqp://guest:guest@127.0.0.1:5672/.
	AMQPURL string
	// MongoURI is MONGO_URI; the embedded server listens on its address.
	// Default: mongodb://127.0.0.1:27017/shipping.
	MongoURI string
	// OrdersAddr, RelayAddr, Relay2Addr and ShippingAddr are the processes'
	// HTTP_ADDR. Defaults: 127.0.0.1:8080, 127.0.0.1:8082, 127.0.0.1:8083,
	// 127.0.0.1:8081.
	OrdersAddr, RelayAddr, Relay2Addr, ShippingAddr string
	// UIAddr is where the live view listens. Default: 127.0.0.1:8090.
	UIAddr string
	// AuditAddr is where the loss audit (cmd/audit -every) serves its last
	// report, which the live view shows; AuditEvery is how often it runs.
	// Defaults: 127.0.0.1:8084, 5s.
	AuditAddr  string
	AuditEvery time.Duration
	// Load starts the load generator at LoadRate orders per second.
	// Default: off, 20.
	Load     bool
	LoadRate float64
	// ReadyTimeout bounds each process's start. Default: 60s.
	ReadyTimeout time.Duration
	// StopTimeout is the grace period after SIGTERM, before SIGKILL.
	// Default: 20s.
	StopTimeout time.Duration
	// Compose, when set, is a compose file whose running project the demo
	// serves the live view for, instead of running processes (compose.go).
	Compose string
	// JaegerUI is JAEGER_UI, the Jaeger UI (http://host:port) the live
	// view's journey links each event's trace to. Default: none, no links;
	// with -compose, the project's jaeger service when it publishes its UI.
	JaegerUI string
}

const (
	defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/orders_demo?sslmode=disable"
	defaultAMQPURL     = "amqp://guest:guest@127.0.0.1:5672/"
	defaultMongoURI    = "mongodb://127.0.0.1:27017/shipping"
)

func parseConfig(args []string, getenv func(string) string, out io.Writer) (config, error) {
	c := config{
		DatabaseURL: cmp.Or(getenv("DATABASE_URL"), defaultDatabaseURL),
		AMQPURL:     cmp.Or(getenv("AMQP_URL"), defaultAMQPURL),
		MongoURI:    cmp.Or(getenv("MONGO_URI"), defaultMongoURI),
		JaegerUI:    getenv("JAEGER_UI"),
	}
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.SetOutput(out)
	fs.StringVar(&c.BinDir, "bin", "", "directory of the orders, shipping, mongolocal, audit and loadgen binaries (default: the demo binary's)")
	fs.StringVar(&c.StateDir, "state", "", "directory for the embedded MongoDB's data and the pid files (default: outbox-inbox/demo in the user cache dir)")
	fs.StringVar(&c.OrdersAddr, "orders-addr", "127.0.0.1:8080", "HTTP_ADDR of the orders API")
	fs.StringVar(&c.ShippingAddr, "shipping-addr", "127.0.0.1:8081", "HTTP_ADDR of the shipping API")
	fs.StringVar(&c.RelayAddr, "relay-addr", "127.0.0.1:8082", "HTTP_ADDR of relay-1 (health and metrics)")
	fs.StringVar(&c.Relay2Addr, "relay2-addr", "127.0.0.1:8083", "HTTP_ADDR of relay-2 (health and metrics)")
	fs.StringVar(&c.UIAddr, "ui-addr", "127.0.0.1:8090", "address of the live view (the web page)")
	fs.StringVar(&c.AuditAddr, "audit-addr", "127.0.0.1:8084", "address of the loss audit's /report and /metrics (cmd/audit -every)")
	fs.DurationVar(&c.AuditEvery, "audit-every", 5*time.Second, "how often the loss audit runs")
	fs.BoolVar(&c.Load, "load", false, "also run the load generator")
	fs.Float64Var(&c.LoadRate, "load-rate", 20, "orders per second of the load generator")
	fs.DurationVar(&c.ReadyTimeout, "ready-timeout", time.Minute, "how long each process may take to become ready")
	fs.StringVar(&c.Compose, "compose", "", "serve the live view for this compose file's running project instead of running local processes (deploy/demo.sh starts it)")
	fs.DurationVar(&c.StopTimeout, "stop-timeout", 20*time.Second, "grace period after SIGTERM before SIGKILL")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if fs.NArg() > 0 {
		return c, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if c.BinDir == "" {
		exe, err := os.Executable()
		if err != nil {
			return c, fmt.Errorf("find the demo binary's directory (use -bin): %w", err)
		}
		c.BinDir = filepath.Dir(exe)
	}
	if c.StateDir == "" {
		dir, err := os.UserCacheDir()
		if err != nil {
			return c, fmt.Errorf("find a state directory (use -state): %w", err)
		}
		c.StateDir = filepath.Join(dir, "outbox-inbox", "demo")
	}
	return c, c.validate()
}

func (c config) validate() error {
	var errs []error
	if c.JaegerUI != "" {
		if u, err := url.Parse(c.JaegerUI); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			errs = append(errs, fmt.Errorf("JAEGER_UI %q: want http://host:port", redacted(c.JaegerUI)))
		}
	}
	if c.Compose != "" {
		if st, err := os.Stat(c.Compose); err != nil || st.IsDir() {
			errs = append(errs, fmt.Errorf("-compose %s: no such file", c.Compose))
		}
		if _, _, err := net.SplitHostPort(c.UIAddr); err != nil {
			errs = append(errs, fmt.Errorf("-ui-addr %q: want host:port", c.UIAddr))
		}
		// The other addresses and URLs are the compose project's, read
		// from it at start.
		return errors.Join(errs...)
	}
	for _, name := range []string{"orders", "shipping", "mongolocal", "audit", "loadgen"} {
		if st, err := os.Stat(filepath.Join(c.BinDir, name)); err != nil || st.IsDir() {
			errs = append(errs, fmt.Errorf("-bin %s: no %s binary there (deploy/demo.sh builds them)", c.BinDir, name))
		}
	}
	seen := map[string]bool{}
	for _, a := range []struct{ flag, addr string }{
		{"-orders-addr", c.OrdersAddr}, {"-shipping-addr", c.ShippingAddr}, {"-relay-addr", c.RelayAddr},
		{"-relay2-addr", c.Relay2Addr}, {"-ui-addr", c.UIAddr}, {"-audit-addr", c.AuditAddr},
	} {
		if _, _, err := net.SplitHostPort(a.addr); err != nil {
			errs = append(errs, fmt.Errorf("%s %q: want host:port", a.flag, a.addr))
		}
		seen[a.addr] = true
	}
	if len(seen) < 6 {
		errs = append(errs, errors.New("-orders-addr, -shipping-addr, -relay-addr, -relay2-addr, -ui-addr and -audit-addr must differ"))
	}
	if c.AuditEvery < time.Second {
		errs = append(errs, fmt.Errorf("-audit-every %v: want at least 1s", c.AuditEvery))
	}
	if u, err := url.Parse(c.DatabaseURL); err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		errs = append(errs, fmt.Errorf("DATABASE_URL %q: want postgres://...", redacted(c.DatabaseURL)))
	}
	if u, err := url.Parse(c.AMQPURL); err != nil || (u.Scheme != "amqp" && u.Scheme != "amqps") {
		errs = append(errs, fmt.Errorf("AMQP_URL %q: want amqp://...", redacted(c.AMQPURL)))
	}
	if _, err := mongoAddr(c.MongoURI); err != nil {
		errs = append(errs, err)
	}
	if !(c.LoadRate > 0) {
		errs = append(errs, fmt.Errorf("-load-rate %v: want a positive rate", c.LoadRate))
	}
	if c.ReadyTimeout <= 0 || c.StopTimeout <= 0 {
		errs = append(errs, errors.New("-ready-timeout and -stop-timeout must be positive"))
	}
	return errors.Join(errs...)
}

// mongoAddr returns the host:port of a single-host mongodb:// URI.
func mongoAddr(uri string) (string, error) {
	u, err := url.Parse(uri)
	if err != nil || u.Scheme != "mongodb" || u.Host == "" || strings.Contains(u.Host, ",") {
		return "", fmt.Errorf("MONGO_URI %q: want mongodb://host:port/database", redacted(uri))
	}
	if _, _, err := net.SplitHostPort(u.Host); err != nil {
		return net.JoinHostPort(u.Host, "27017"), nil
	}
	return u.Host, nil
}

// redacted hides a URL's password for printing. A URL that does not parse
// (a bad escape, say) has its password hidden all the same.
func redacted(raw string) string {
	if u, err := url.Parse(raw); err == nil {
		return u.Redacted()
	}
	scheme, rest, ok := strings.Cut(raw, "://")
	if !ok {
		return raw
	}
	authority := rest
	if i := strings.IndexAny(rest, "/?#"); i >= 0 {
		authority = rest[:i]
	}
	at := strings.LastIndexByte(authority, '@')
	if at < 0 {
		return raw
	}
	user, _, hasPassword := strings.Cut(authority[:at], ":")
	if !hasPassword {
		return raw
	}
	return scheme + "://" + user + ":xxxxx" + rest[at:]
}
