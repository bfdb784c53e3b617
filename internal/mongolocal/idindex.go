package mongolocal

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"

	_ "modernc.org/sqlite" // the SQLite driver FerretDB itself uses
)

// FerretDB 1.24's SQLite backend keeps each collection in a table with one
// JSON column, _ferretdb_sjson, and its _id index on the expression
// _ferretdb_sjson->"_id". Its finds, updates and deletes by _id select on
// _ferretdb_sjson->'$._id' instead: the same value, but SQLite matches index
// expressions by their text, so every one of those statements scans the whole
// collection, and an inbox lookup gets slower with every record (2 ms at 1,000
// documents, 7.5 ms at 5,000 here). Unique _id on insert is unaffected.
//
// MongoDB serves those statements from its _id index. So that code measured
// on this server is not measured against a full scan MongoDB never does, the
// server adds to every collection table an index on the expression the
// statements use, named <table>__mongolocal_id; clients do not see it
// (listIndexes reads FerretDB's own metadata). New collections get theirs
// within IDIndexInterval of being created; until then their lookups scan, as
// before.

// idColumn is the expression FerretDB's statements select _id by.
const idColumn = `_ferretdb_sjson->'$._id'`

// idIndexSuffix names the added index after its table.
const idIndexSuffix = "__mongolocal_id"

// indexIDLookups adds the index to every collection table of every database
// file in dir that lacks it. Each file is
// opened for the call only, so a database dropped and created again is seen
// as it is now.
func indexIDLookups(ctx context.Context, dir string) error {
	files, err := filepath.Glob(filepath.Join(dir, "*.sqlite"))
	if err != nil {
		return err
	}
	var errs []error
	for _, file := range files {
		if err := indexFile(ctx, file); err != nil && ctx.Err() == nil {
			errs = append(errs, fmt.Errorf("%s: %w", filepath.Base(file), err))
		}
	}
	return errors.Join(errs...)
}

func indexFile(ctx context.Context, file string) (err error) {
	if _, err := os.Stat(file); err != nil {
		return nil // dropped meanwhile
	}
	// The pragmas FerretDB opens its files with: in WAL mode this connection
	// and FerretDB's share the file, and the busy timeout makes either wait
	// for the other's write instead of failing. mode=rw: never create a file.
	u := url.URL{Scheme: "file", Path: filepath.ToSlash(file),
		RawQuery: "mode=rw&_pragma=busy_timeout(10000)&_pragma=journal_mode(wal)"}
	db, err := sql.Open("sqlite", u.String())
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, db.Close()) }()
	db.SetMaxOpenConns(1)

	rows, err := db.QueryContext(ctx, `
		SELECT c.table_name FROM _ferretdb_collections c
		WHERE NOT EXISTS (SELECT 1 FROM sqlite_master m WHERE m.type = 'index' AND m.name = c.table_name || ?)`,
		idIndexSuffix)
	if err != nil {
		if isGone(err) {
			return nil // no metadata yet, or the file went away
		}
		return err
	}
	var tables []string
	for rows.Next() {
		var t string
		if err := rows.Scan(&t); err != nil {
			_ = rows.Close()
			return err
		}
		tables = append(tables, t)
	}
	if err := rows.Close(); err != nil {
		return err
	}
	for _, t := range tables {
		q := fmt.Sprintf(`CREATE INDEX IF NOT EXISTS %q ON %q (%s)`, t+idIndexSuffix, t, idColumn)
		if _, err := db.ExecContext(ctx, q); err != nil {
			if isGone(err) {
				continue // dropped since listed
			}
			return fmt.Errorf("index %s: %w", t, err)
		}
	}
	return nil
}

func isGone(err error) bool {
	msg := err.Error()
	return strings.Contains(msg, "no such table") || strings.Contains(msg, "unable to open")
}

// runIDIndexer calls indexIDLookups every interval until ctx ends.
func runIDIndexer(ctx context.Context, dir string, interval time.Duration, log *slog.Logger) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		if err := indexIDLookups(ctx, dir); err != nil {
			log.Error("mongolocal: index _id lookups", "error", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
