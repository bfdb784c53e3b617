package main

import (
	"bufio"
	"context"
	"io"
	"regexp"
	"strings"
	"testing"
	"time"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func env(m map[string]string) func(string) string { return func(k string) string { return m[k] } }

func TestServesUntilCancelled(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	pr, pw := io.Pipe()
	dataDir := t.TempDir()
	errc := make(chan error, 1)
	go func() {
		err := run(ctx, []string{"-addr", "127.0.0.1:0"}, env(map[string]string{"MONGOLOCAL_DATA_DIR": dataDir}), pw)
		pw.Close()
		errc <- err
	}()

	lines := bufio.NewScanner(pr)
	var uri string
	for uri == "" && lines.Scan() {
		if m := regexp.MustCompile(`uri=(mongodb://\S+)`).FindStringSubmatch(lines.Text()); m != nil {
			uri = m[1]
			if !strings.Contains(lines.Text(), "data_dir="+dataDir) {
				t.Errorf("start line %q does not name the data dir %s", lines.Text(), dataDir)
			}
		}
	}
	if uri == "" {
		t.Fatalf("no listening line in the output (run: %v)", <-errc)
	}
	go func() { _, _ = io.Copy(io.Discard, pr) }()

	c, err := mongo.Connect(options.Client().ApplyURI(uri).SetServerSelectionTimeout(5 * time.Second))
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	if _, err := c.Database("shipping").Collection("c").InsertOne(ctx, bson.D{{Key: "ok", Value: true}}); err != nil {
		t.Fatalf("insert through %s: %v", uri, err)
	}
	_ = c.Disconnect(ctx)

	cancel()
	select {
	case err := <-errc:
		if err != nil {
			t.Fatalf("run returned %v after cancel, want nil", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("run did not return 30s after cancel")
	}
}

func TestRejectsBadInput(t *testing.T) {
	for name, tc := range map[string]struct {
		args []string
		env  map[string]string
	}{
		"two hosts":       {env: map[string]string{"MONGO_URI": "mongodb://a:1,b:2"}},
		"srv":             {env: map[string]string{"MONGO_URI": "mongodb+srv://example.test"}},
		"not a URI":       {env: map[string]string{"MONGO_URI": "127.0.0.1:27017"}},
		"unknown flag":    {args: []string{"-nope"}},
		"extra argument":  {args: []string{"serve"}},
		"bad listen addr": {args: []string{"-addr", "nowhere"}},
	} {
		t.Run(name, func(t *testing.T) {
			if err := run(t.Context(), tc.args, env(tc.env), io.Discard); err == nil {
				t.Fatal("run succeeded, want an error")
			}
		})
	}
}

func TestAddrFromURI(t *testing.T) {
	for uri, want := range map[string]string{
		"mongodb://127.0.0.1:27017":                         "127.0.0.1:27017",
		"mongodb://localhost/shipping":                      "localhost:27017",
		"mongodb://u:p@127.0.0.1:27018/db?authSource=admin": "127.0.0.1:27018",
	} {
		got, err := addrFromURI(uri)
		if err != nil || got != want {
			t.Errorf("addrFromURI(%q) = %q, %v; want %q", uri, got, err, want)
		}
	}
}
