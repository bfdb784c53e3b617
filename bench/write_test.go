package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// namedQuery returns the statement of the query named name in sqlc's
// queries file: the text after its "-- name: <name> :<kind>" line up to the
// next query's, without comment lines or the final semicolon.
func namedQuery(t *testing.T, queries, name string) string {
	t.Helper()
	for _, block := range strings.Split(queries, "-- name: ")[1:] {
		header, body, _ := strings.Cut(block, "\n")
		if fields := strings.Fields(header); len(fields) == 0 || fields[0] != name {
			continue
		}
		var lines []string
		for _, line := range strings.Split(body, "\n") {
			if !strings.HasPrefix(strings.TrimSpace(line), "--") {
				lines = append(lines, line)
			}
		}
		return strings.TrimSuffix(strings.TrimSpace(strings.Join(lines, "\n")), ";")
	}
	t.Fatalf("no query %q in %s", name, ordersQueriesPath)
	return ""
}

// write_overhead times the statement the orders store sends: the INSERT the
// benchmark repeats is the InsertOrder query sqlc generates the store's
// code from.
func TestInsertOrderSQLIsTheStores(t *testing.T) {
	root, err := moduleRoot()
	if err != nil {
		t.Fatal(err)
	}
	queries, err := os.ReadFile(filepath.Join(root, ordersQueriesPath))
	if err != nil {
		t.Fatal(err)
	}
	want := strings.Join(strings.Fields(namedQuery(t, string(queries), "InsertOrder")), " ")
	if got := strings.Join(strings.Fields(insertOrderSQL), " "); got != want {
		t.Fatalf("bench's insertOrderSQL is\n%s\nthe store's InsertOrder (%s) is\n%s", got, ordersQueriesPath, want)
	}
}
