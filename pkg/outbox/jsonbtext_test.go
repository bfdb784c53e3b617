package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// jsonbCases are JSON documents at the edges of what jsonb stores and how it
// prints them: numbers at numeric's limits, escapes, nesting, whitespace.
var jsonbCases = []string{
	`-0`, `-0.0`, `0e5`, `0.000e-3`, `1e131071`, `1e131072`, `9.9e131071`, `10e131070`, `-1e131071`,
	`1e-16383`, `1e-16384`, `0.1e-16382`, `1.5e-16383`, `1e-20000`, `0e-20000`, `0e-16384`, `0e200000`,
	`0e1000000000`, `0e1073741822`, `0e1073741823`, `0e-1073741823`, `0e99999999999999999999999`,
	`0.0e131080`, `-0e-5`, `0.000123e4`, `0.00e16385`, `100e-2`, `12.340`, `1E+2`, `-1.0e1`, `0.000123`,
	`123456789.1234e-5`, `-5e-16383`, `1.0e-16382`, `[1.0E-2]`, `[-0.0e-0]`,
	`"\u00e9\/a\b\u0001"`, `"\ud800"`, `"\udc00"`, `"\ud800\u0041"`, `"\ud83d\ude00"`, `"\ud800\ud800"`,
	`"\uDBFF\uDFFF"`, `"\u007f"`, `"\u001F"`, `"\u0000"`, `"\\u0000"`, `"\u005c\u0022\u000a"`, `"a\u2028"`,
	`"\ud83d\ude00\ud800x"`, `"\ud83d"`, `"tab	inside"`,
	`[[],{},""]`, ` { "b" : 1 , "a" : [ 1 , { "c" : null } ] } `, `{"a":{"a":{"a":[true,false,null]}}}`,
	"[" + strings.Repeat("1e100,", 50) + "1]",
	strings.Repeat("[", 5000) + strings.Repeat("]", 5000),
	strings.Repeat(`{"k":`, 2000) + "0" + strings.Repeat("}", 2000),
	`"` + strings.Repeat("é\\n\\u00e9", 1000) + `"`,
}

// The text form Enqueue computes is the one PostgreSQL prints, to the byte,
// and what PostgreSQL refuses is refused.
func TestJSONBTextSizeIsPostgreSQLs(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	for _, doc := range jsonbCases {
		size, err := int64(0), errors.New("not valid JSON")
		if json.Valid([]byte(doc)) {
			size, err = outbox.JSONBTextSize([]byte(doc))
		}
		var text string
		pgErr := pool.QueryRow(ctx, `SELECT $1::jsonb::text`, doc).Scan(&text)
		name := doc
		if len(name) > 40 {
			name = name[:40] + "..."
		}
		switch {
		case err != nil && pgErr == nil:
			t.Errorf("%s: refused (%v), PostgreSQL stores it", name, err)
		case err == nil && pgErr != nil:
			t.Errorf("%s: accepted, PostgreSQL refuses it: %v", name, pgErr)
		case err == nil && size != int64(len(text)):
			t.Errorf("%s: %d bytes, PostgreSQL prints %d", name, size, len(text))
		}
	}
}

// A payload a few kilobytes long whose text form is over PostgreSQL's 1 GB
// limit: Enqueue used to accept it, then every claim that measured it failed
// after about 10 s, and no event of any aggregate was published.
func TestEnqueueRefusesAPayloadWhoseTextFormIsOverTheLimit(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()

	bomb := "[" + strings.TrimSuffix(strings.Repeat("1e131071,", 8200), ",") + "]" // 73,801 bytes
	small := "[" + strings.TrimSuffix(strings.Repeat("1e131071,", 7), ",") + "]"   // 917,511 bytes printed
	over := "[" + strings.TrimSuffix(strings.Repeat("1e131071,", 8), ",") + "]"    // 1,048,590 bytes printed
	unlimited, err := outbox.NewWriter(outbox.WriterConfig{MaxPayloadBytes: -1})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name    string
		w       *outbox.Writer
		payload string
		ok      bool
	}{
		{"over 1 GB printed", &outbox.Writer{}, bomb, false},
		{"over 1 GB printed, no limit", unlimited, bomb, false},
		{"just over the default limit printed", &outbox.Writer{}, over, false},
		{"under the default limit printed", &outbox.Writer{}, small, true},
		{"over the default limit, no limit", unlimited, over, true},
	} {
		m := msg("o-"+tc.name, "order.created")
		m.Payload = []byte(tc.payload)
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := tc.w.Enqueue(ctx, tx, m)
			return err
		})
		if tc.ok && err != nil {
			t.Errorf("%s: %v", tc.name, err)
		}
		if !tc.ok && !errors.Is(err, outbox.ErrInvalidMessage) {
			t.Errorf("%s: error %v, want ErrInvalidMessage", tc.name, err)
		}
	}
	if n := countRows(t, pool); n != 2 {
		t.Fatalf("outbox has %d rows, want the 2 accepted", n)
	}
}
