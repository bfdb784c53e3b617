package mongolocal_test

import (
	"database/sql"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
	_ "modernc.org/sqlite"

	"github.com/outbox-inbox/reference/internal/mongolocal"
)

// lookupPlan returns SQLite's plan for FerretDB's find-by-_id statement on
// collection coll of database dbName, and the collection's table.
func lookupPlan(t *testing.T, s *mongolocal.Server, dbName, coll string) (plan, table string) {
	t.Helper()
	db, err := sql.Open("sqlite", "file:"+filepath.Join(s.DataDir(), dbName+".sqlite")+"?mode=ro")
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if err := db.QueryRow(`SELECT table_name FROM _ferretdb_collections WHERE name = ?`, coll).Scan(&table); err != nil {
		t.Fatalf("table of %s: %v", coll, err)
	}
	// The statement of FerretDB 1.24's sqlite backend for {_id: <string>}
	// (internal/backends/sqlite/collection.go, Query).
	rows, err := db.Query(fmt.Sprintf(`EXPLAIN QUERY PLAN SELECT _ferretdb_sjson FROM %q WHERE _ferretdb_sjson->'$._id' = ?`, table), `"k-1"`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var steps []string
	for rows.Next() {
		var id, parent, unused int
		var detail string
		if err := rows.Scan(&id, &parent, &unused, &detail); err != nil {
			t.Fatal(err)
		}
		steps = append(steps, detail)
	}
	return strings.Join(steps, "; "), table
}

func insertKeys(t *testing.T, c *mongo.Collection, n int) {
	t.Helper()
	docs := make([]any, n)
	for i := range docs {
		docs[i] = bson.D{{Key: "_id", Value: fmt.Sprintf("k-%d", i)}, {Key: "state", Value: "done"}}
	}
	if _, err := c.InsertMany(t.Context(), docs); err != nil {
		t.Fatalf("insert: %v", err)
	}
}

func waitForPlan(t *testing.T, s *mongolocal.Server, dbName, coll, want string) string {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		plan, table := lookupPlan(t, s, dbName, coll)
		if strings.Contains(plan, want) {
			return table
		}
		if time.Now().After(deadline) {
			t.Fatalf("plan of a find by _id on %s: %q, want it to contain %q", coll, plan, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// FerretDB as released scans the collection for a find by _id; the server's
// added index turns that into an index search, for new collections and for a
// collection dropped and created again, and lookups still find the right
// documents.
func TestFindByIDUsesAnIndex(t *testing.T) {
	t.Parallel()
	s := start(t, mongolocal.Config{IDIndexInterval: 10 * time.Millisecond})
	c := connect(t, s.URI())
	coll := c.Database("idx").Collection("inbox")
	insertKeys(t, coll, 500)

	table := waitForPlan(t, s, "idx", "inbox", "USING INDEX")
	if plan, _ := lookupPlan(t, s, "idx", "inbox"); !strings.Contains(plan, table+"__mongolocal_id") {
		t.Fatalf("plan %q does not use the added index", plan)
	}
	for _, id := range []string{"k-0", "k-499"} {
		var doc bson.M
		if err := coll.FindOne(t.Context(), bson.D{{Key: "_id", Value: id}}).Decode(&doc); err != nil || doc["_id"] != id {
			t.Fatalf("FindOne(%s) = %v, %v", id, doc, err)
		}
	}
	if err := coll.FindOne(t.Context(), bson.D{{Key: "_id", Value: "k-500"}}).Err(); err != mongo.ErrNoDocuments {
		t.Fatalf("FindOne(missing) error = %v, want ErrNoDocuments", err)
	}
	// Clients see only FerretDB's own index.
	specs, err := coll.Indexes().ListSpecifications(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if len(specs) != 1 || specs[0].Name != "_id_" {
		t.Fatalf("listIndexes = %+v, want _id_ alone", specs)
	}

	if err := coll.Drop(t.Context()); err != nil {
		t.Fatal(err)
	}
	insertKeys(t, coll, 10)
	waitForPlan(t, s, "idx", "inbox", "USING INDEX")
}

// Without the added index the same statement scans: the test above would see
// a scan if the server did nothing.
func TestFindByIDScansWithoutTheAddedIndex(t *testing.T) {
	t.Parallel()
	s := start(t, mongolocal.Config{IDIndexInterval: -1})
	c := connect(t, s.URI())
	insertKeys(t, c.Database("idx").Collection("inbox"), 10)
	time.Sleep(100 * time.Millisecond)
	if plan, _ := lookupPlan(t, s, "idx", "inbox"); !strings.Contains(plan, "SCAN") || strings.Contains(plan, "INDEX") {
		t.Fatalf("plan without the added index: %q, want a scan", plan)
	}
}
