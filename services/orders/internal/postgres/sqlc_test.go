package postgres_test

import (
	"bytes"
	"crypto/sha256"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// sqlcModule is the sqlc release the generated code comes from; the Makefile's
// generate target runs the same.
const sqlcModule = "github.com/sqlc-dev/sqlc/cmd/sqlc@v1.31.1"

var update = flag.Bool("update", false, "rewrite ordersdb/sqlc.sum from the files as they are (make generate runs it right after sqlc generate)")

// sqlcSumPath records the checksums of sqlc's inputs and of the code it
// generated from them, as sha256sum prints them.
const sqlcSumPath = "ordersdb/sqlc.sum"

// sqlcFiles returns sqlc's inputs and the generated files, sorted.
func sqlcFiles(t *testing.T) []string {
	t.Helper()
	generated, err := filepath.Glob("ordersdb/*.go")
	if err != nil || len(generated) == 0 {
		t.Fatalf("no generated code in ordersdb (%v): run make generate", err)
	}
	files := append([]string{"sqlc.yaml", "schema.sql", "queries.sql"}, generated...)
	slices.Sort(files)
	return files
}

func sqlcSum(t *testing.T) string {
	t.Helper()
	var b strings.Builder
	for _, f := range sqlcFiles(t) {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(&b, "%x  %s\n", sha256.Sum256(data), f)
	}
	return b.String()
}

// The generated queries are those sqlc makes from queries.sql, schema.sql and
// sqlc.yaml as they are: editing one of them, or the generated code, without
// running make generate fails here. Running sqlc itself costs minutes on a
// cold build cache, so the test compares checksums that make generate records
// right after sqlc wrote the code; with SQLC_DIFF=1 it also runs `sqlc diff`
// (the pinned release, through go run), which compares the code itself.
func TestGeneratedQueriesAreCurrent(t *testing.T) {
	got := sqlcSum(t)
	if *update {
		if err := os.WriteFile(sqlcSumPath, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(sqlcSumPath)
	if err != nil {
		t.Fatalf("read %s: %v (run make generate)", sqlcSumPath, err)
	}
	if got != string(want) {
		// The files whose line is in one sum and not the other: changed,
		// added or removed.
		var changed []string
		gotLines, wantLines := strings.Split(got, "\n"), strings.Split(string(want), "\n")
		for _, pair := range [][2][]string{{gotLines, wantLines}, {wantLines, gotLines}} {
			for _, line := range pair[0] {
				_, file, ok := strings.Cut(line, "  ")
				if ok && !slices.Contains(pair[1], line) && !slices.Contains(changed, file) {
					changed = append(changed, file)
				}
			}
		}
		t.Fatalf("the generated queries are stale: %s changed since sqlc generated ordersdb (recorded in %s); run make generate and commit the result",
			strings.Join(changed, ", "), sqlcSumPath)
	}

	if os.Getenv("SQLC_DIFF") != "1" {
		return
	}
	cmd := exec.CommandContext(t.Context(), "go", "run", sqlcModule, "diff")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		t.Fatalf("sqlc diff: %v\n%s", err, out.String())
	}
}
