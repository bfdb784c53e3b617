package mongolocal_test

import (
	"context"
	"errors"
	"io/fs"
	"net"
	"os"
	"testing"
	"time"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"
	"go.uber.org/goleak"

	"github.com/outbox-inbox/reference/internal/mongolocal"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func start(t *testing.T, cfg mongolocal.Config) *mongolocal.Server {
	t.Helper()
	s, err := mongolocal.Start(t.Context(), cfg)
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return s
}

func connect(t *testing.T, uri string) *mongo.Client {
	t.Helper()
	c, err := mongo.Connect(options.Client().ApplyURI(uri).SetServerSelectionTimeout(5 * time.Second))
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(func() { _ = c.Disconnect(context.WithoutCancel(t.Context())) })
	return c
}

func TestServesOnAFreePortAndCleansUp(t *testing.T) {
	t.Parallel()
	s := start(t, mongolocal.Config{})
	if want := "mongodb://" + s.Addr() + "/"; s.URI() != want {
		t.Fatalf("URI %q, want %q", s.URI(), want)
	}
	c := connect(t, s.URI())
	coll := c.Database("db").Collection("c")
	if _, err := coll.InsertOne(t.Context(), bson.D{{Key: "_id", Value: "a"}}); err != nil {
		t.Fatalf("insert: %v", err)
	}
	_, err := coll.InsertOne(t.Context(), bson.D{{Key: "_id", Value: "a"}})
	if !mongo.IsDuplicateKeyError(err) {
		t.Fatalf("second insert of the same _id: got %v, want a duplicate-key error", err)
	}
	if err := c.Disconnect(t.Context()); err != nil {
		t.Fatalf("disconnect: %v", err)
	}

	if err := s.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	select {
	case <-s.Done():
	default:
		t.Fatal("Done not closed after Close")
	}
	if _, err := os.Stat(s.DataDir()); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("temporary data dir %s still there after Close: %v", s.DataDir(), err)
	}
	if conn, err := net.DialTimeout("tcp", s.Addr(), time.Second); err == nil {
		conn.Close()
		t.Fatalf("%s still accepts connections after Close", s.Addr())
	}
}

func TestDataDirSurvivesARestartOnTheSameAddress(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	s1, err := mongolocal.Start(t.Context(), mongolocal.Config{DataDir: dir})
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	c := connect(t, s1.URI())
	if _, err := c.Database("keep").Collection("c").InsertOne(t.Context(), bson.D{{Key: "_id", Value: 1}}); err != nil {
		t.Fatalf("insert: %v", err)
	}
	_ = c.Disconnect(t.Context())
	if err := s1.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if _, err := os.Stat(dir); err != nil {
		t.Fatalf("a given DataDir must be kept: %v", err)
	}

	s2 := start(t, mongolocal.Config{Addr: s1.Addr(), DataDir: dir})
	if s2.Addr() != s1.Addr() {
		t.Fatalf("restarted on %s, want %s", s2.Addr(), s1.Addr())
	}
	n, err := connect(t, s2.URI()).Database("keep").Collection("c").CountDocuments(t.Context(), bson.D{})
	if err != nil || n != 1 {
		t.Fatalf("after restart: %d documents, %v; want 1", n, err)
	}
}

func TestStopsWhenItsContextEnds(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(t.Context())
	s, err := mongolocal.Start(ctx, mongolocal.Config{})
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	cancel()
	select {
	case <-s.Done():
	case <-time.After(30 * time.Second):
		t.Fatal("server still running 30s after its context ended")
	}
	if err := s.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
}

func TestStopIsBoundedByItsContext(t *testing.T) {
	t.Parallel()
	s := start(t, mongolocal.Config{})
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	if err := s.Stop(ctx); err != nil {
		t.Fatalf("Stop: %v", err)
	}
}

func TestRejectsBadConfig(t *testing.T) {
	t.Parallel()
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	file := t.TempDir() + "/file"
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for name, cfg := range map[string]mongolocal.Config{
		"address without port": {Addr: "127.0.0.1"},
		"address in use":       {Addr: busy.Addr().String()},
		"data dir is a file":   {DataDir: file},
	} {
		t.Run(name, func(t *testing.T) {
			s, err := mongolocal.Start(t.Context(), cfg)
			if err == nil {
				s.Close()
				t.Fatalf("Start(%+v) succeeded, want an error", cfg)
			}
		})
	}
}

// TestFerretDBLimits pins the behaviours pkg/inbox and the shipping service
// rely on, so an upgrade that changes them fails here first.
func TestFerretDBLimits(t *testing.T) {
	t.Parallel()
	s := start(t, mongolocal.Config{})
	c := connect(t, s.URI())
	ctx := t.Context()

	var hello struct {
		SetName string `bson:"setName"`
		Msg     string `bson:"msg"`
	}
	if err := c.Database("admin").RunCommand(ctx, bson.D{{Key: "hello", Value: 1}}).Decode(&hello); err != nil {
		t.Fatalf("hello: %v", err)
	}
	if hello.SetName != "" || hello.Msg != "" {
		t.Fatalf("hello reports setName %q msg %q: FerretDB now looks like a replica set or mongos", hello.SetName, hello.Msg)
	}

	coll := c.Database("limits").Collection("c")
	_, err := coll.Indexes().CreateOne(ctx, mongo.IndexModel{
		Keys:    bson.D{{Key: "expire_at", Value: 1}},
		Options: options.Index().SetExpireAfterSeconds(0),
	})
	var ce mongo.CommandError
	if !errors.As(err, &ce) || ce.Code != 238 {
		t.Fatalf("TTL index: got %v, want NotImplemented (238)", err)
	}

	sess, err := c.StartSession()
	if err != nil {
		t.Fatalf("start session: %v", err)
	}
	defer sess.EndSession(ctx)
	if err := sess.StartTransaction(); err != nil {
		t.Fatalf("start transaction: %v", err)
	}
	if _, err := coll.InsertOne(mongo.NewSessionContext(ctx, sess), bson.D{}); err == nil {
		t.Fatal("insert in a transaction succeeded: FerretDB now has transactions")
	}
}
