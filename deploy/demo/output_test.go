package main

import (
	"bytes"
	"os"
	"strings"
	"testing"
	"time"
)

func TestFormatLine(t *testing.T) {
	t.Parallel()
	ts := time.Date(2026, 11, 29, 22, 0, 5, 0, time.UTC)
	clock := ts.Local().Format("15:04:05")
	tests := []struct{ in, want string }{
		{`{"time":"` + ts.Format(time.RFC3339Nano) + `","level":"INFO","msg":"http listening","service":"orders","addr":"127.0.0.1:8080"}`,
			clock + " INFO  http listening addr=127.0.0.1:8080"},
		{`{"level":"WARN","msg":"broker down","error":"dial tcp: connection refused","attempt":3,"ok":false}`,
			`WARN  broker down attempt=3 error="dial tcp: connection refused" ok=false`},
		{`time=2026-11-29T22:00:05Z level=INFO msg="mongolocal listening"`, `time=2026-11-29T22:00:05Z level=INFO msg="mongolocal listening"`},
		{`{not json`, `{not json`},
		{"", ""},
		{"windows line\r", "windows line"},
	}
	for _, tt := range tests {
		if got := formatLine([]byte(tt.in)); got != tt.want {
			t.Errorf("formatLine(%q)\n got %q\nwant %q", tt.in, got, tt.want)
		}
	}
}

func TestPrefixerWritesWholeLinesOnly(t *testing.T) {
	t.Parallel()
	var out bytes.Buffer
	p := newPrefixer(&terminal{w: &out}, "shipping", 10)
	for _, chunk := range []string{"one\ntw", "o\n", "thr", "ee"} {
		if _, err := p.Write([]byte(chunk)); err != nil {
			t.Fatal(err)
		}
	}
	want := "shipping   | one\nshipping   | two\n"
	if out.String() != want {
		t.Fatalf("got %q, want %q (a partial line waits for its newline)", out.String(), want)
	}
	if _, err := p.Write([]byte("\n")); err != nil {
		t.Fatal(err)
	}
	if !strings.HasSuffix(out.String(), "shipping   | three\n") {
		t.Fatalf("got %q", out.String())
	}
}

func TestConfigRejectsBadValues(t *testing.T) {
	t.Parallel()
	bin := t.TempDir()
	for _, name := range []string{"orders", "shipping", "mongolocal", "audit", "loadgen"} {
		if err := writeExecutable(bin + "/" + name); err != nil {
			t.Fatal(err)
		}
	}
	noEnv := func(string) string { return "" }
	tests := []struct {
		args []string
		env  map[string]string
		want string
	}{
		{[]string{"-bin", t.TempDir()}, nil, "no orders binary there"},
		{[]string{"-orders-addr", "8080"}, nil, "-orders-addr"},
		{[]string{"-orders-addr", "127.0.0.1:9", "-shipping-addr", "127.0.0.1:9"}, nil, "must differ"},
		{[]string{"-audit-addr", "127.0.0.1:8080"}, nil, "must differ"},
		{[]string{"-audit-every", "100ms"}, nil, "-audit-every"},
		{[]string{"-load-rate", "0"}, nil, "-load-rate"},
		{nil, map[string]string{"MONGO_URI": "mongodb://a:1,b:2/x"}, "MONGO_URI"},
		{nil, map[string]string{"DATABASE_URL": "mysql://x"}, "DATABASE_URL"},
		{nil, map[string]string{"AMQP_URL": "http://x"}, "AMQP_URL"},
		{nil, map[string]string{"JAEGER_UI": "127.0.0.1:16686"}, "JAEGER_UI"},
		{nil, map[string]string{"MONGO_URI": "mongodb://u:secret@a:1,b:2/x"}, "mongodb://u:xxxxx@a:1,b:2/x"},
		{[]string{"extra"}, nil, "unexpected arguments"},
	}
	for _, tt := range tests {
		getenv := noEnv
		if tt.env != nil {
			getenv = func(k string) string { return tt.env[k] }
		}
		args := append([]string{"-bin", bin, "-state", t.TempDir()}, tt.args...)
		_, err := parseConfig(args, getenv, &bytes.Buffer{})
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("parseConfig(%q, %v) = %v, want an error containing %q", tt.args, tt.env, err, tt.want)
		}
	}

	c, err := parseConfig([]string{"-bin", bin}, noEnv, &bytes.Buffer{})
	if err != nil {
		t.Fatalf("defaults: %v", err)
	}
	if c.DatabaseURL != defaultDatabaseURL || c.AMQPURL != defaultAMQPURL || c.MongoURI != defaultMongoURI ||
		c.OrdersAddr != "127.0.0.1:8080" || c.ShippingAddr != "127.0.0.1:8081" || c.JaegerUI != "" ||
		c.AuditAddr != "127.0.0.1:8084" || c.AuditEvery != 5*time.Second {
		t.Fatalf("defaults: %+v", c)
	}
	if !strings.HasSuffix(c.StateDir, "outbox-inbox/demo") {
		t.Fatalf("default state dir %q", c.StateDir)
	}
}

func writeExecutable(path string) error {
	return os.WriteFile(path, []byte("#!/bin/sh\n"), 0o755)
}
