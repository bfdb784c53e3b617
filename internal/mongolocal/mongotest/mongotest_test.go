package mongotest_test

import (
	"slices"
	"strings"
	"testing"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"
	"go.uber.org/goleak"

	"github.com/outbox-inbox/reference/internal/mongolocal/mongotest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(mongotest.Suite(m)) }

func TestEachTestGetsAFreshDatabaseDroppedAtTheEnd(t *testing.T) {
	t.Parallel()
	var name string
	t.Run("inner", func(t *testing.T) {
		db := mongotest.Database(t)
		name = db.Name()
		if !strings.HasPrefix(name, "t_TestEachTestGetsAFreshDatabaseDr") || len(name) > 63 {
			t.Errorf("database name %q: want the test's name as prefix, at most 63 bytes", name)
		}
		n, err := db.Collection("c").CountDocuments(t.Context(), bson.D{})
		if err != nil || n != 0 {
			t.Fatalf("fresh database has %d documents, %v", n, err)
		}
		if _, err := db.Collection("c").InsertOne(t.Context(), bson.D{{Key: "x", Value: 1}}); err != nil {
			t.Fatalf("insert: %v", err)
		}
	})

	uri, other := mongotest.ForTest(t)
	if other == name {
		t.Fatalf("two calls returned the same database %q", name)
	}
	c, err := mongo.Connect(options.Client().ApplyURI(uri))
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	defer c.Disconnect(t.Context())
	names, err := c.ListDatabaseNames(t.Context(), bson.D{})
	if err != nil {
		t.Fatalf("list databases: %v", err)
	}
	if slices.Contains(names, name) {
		t.Fatalf("database %s still exists after its test ended", name)
	}
}

func TestDatabaseNameIsSafeForAnyTestName(t *testing.T) {
	t.Parallel()
	for _, sub := range []string{"spaces and/slashes", "dots.and$dollars", strings.Repeat("long", 40), "ünïcode"} {
		t.Run(sub, func(t *testing.T) {
			name := mongotest.DatabaseName(t)
			if len(name) > 63 {
				t.Fatalf("%q is longer than 63 bytes", name)
			}
			for _, r := range name {
				if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '_' || r == '-') {
					t.Fatalf("%q contains %q", name, r)
				}
			}
		})
	}
}
