package vacuum

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// fakeDB answers AutovacuumSQL from its list of answers (an error, or
// whether autovacuum is on) and records each VACUUM.
type fakeDB struct {
	mu       sync.Mutex
	answers  []any // error or bool, one per question; the last one repeats
	asked    int
	vacuums  chan struct{}
	unwanted []string
}

func newFakeDB(answers ...any) *fakeDB {
	return &fakeDB{answers: answers, vacuums: make(chan struct{}, 100)}
}

func (f *fakeDB) Exec(_ context.Context, sql string, _ ...any) (pgconn.CommandTag, error) {
	if sql != SQL {
		f.mu.Lock()
		f.unwanted = append(f.unwanted, sql)
		f.mu.Unlock()
	}
	f.vacuums <- struct{}{}
	return pgconn.NewCommandTag("VACUUM"), nil
}

func (f *fakeDB) QueryRow(_ context.Context, sql string, _ ...any) pgx.Row {
	f.mu.Lock()
	defer f.mu.Unlock()
	a := f.answers[min(f.asked, len(f.answers)-1)]
	f.asked++
	return row{a}
}

type row struct{ answer any }

func (r row) Scan(dest ...any) error {
	if err, ok := r.answer.(error); ok {
		return err
	}
	*dest[0].(*bool) = r.answer.(bool)
	return nil
}

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// start runs v until the test ends, and returns once Run decided.
func start(t *testing.T, v *Vacuumer) (done <-chan struct{}) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	ended := make(chan struct{})
	go func() { defer close(ended); v.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-ended })
	return ended
}

func waitDecided(t *testing.T, v *Vacuumer) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for v.interval.Load() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("Run did not decide")
		}
		time.Sleep(time.Millisecond)
	}
}

// vacuums counts the vacuums that come within d, or until want came and no
// other within 100ms.
func vacuums(f *fakeDB, d time.Duration, want int) int {
	n := 0
	timeout := time.After(d)
	for {
		settle := time.After(100 * time.Millisecond)
		if n < want {
			settle = nil
		}
		select {
		case <-f.vacuums:
			n++
		case <-settle:
			return n
		case <-timeout:
			return n
		}
	}
}

func (f *fakeDB) questions() (int, []string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.asked, f.unwanted
}

// With a number of rows, it vacuums each time that many were counted, by
// any number of goroutines, and not at start.
func TestVacuumsEveryNRowsCounted(t *testing.T) {
	db := newFakeDB(errors.New("not asked with a number of rows"))
	v := New(db, quiet(), "test relay", 100)
	start(t, v)
	waitDecided(t, v)
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for range 25 {
				v.Counted(1)
			}
		})
	}
	wg.Wait()
	if n := vacuums(db, 10*time.Second, 1); n != 1 {
		t.Fatalf("100 rows counted by 4 goroutines: %d vacuums, want 1", n)
	}
	v.Counted(99)
	if n := vacuums(db, 100*time.Millisecond, 0); n != 0 {
		t.Fatalf("99 more rows: %d vacuums, want 0", n)
	}
	v.Counted(1)
	if n := vacuums(db, 10*time.Second, 1); n != 1 {
		t.Fatalf("the 100th: %d vacuums, want 1", n)
	}
	if asked, unwanted := db.questions(); asked != 0 || len(unwanted) > 0 {
		t.Fatalf("asked %d questions, ran %q", asked, unwanted)
	}
}

// In auto mode it asks whether autovacuum covers the table, retrying a
// question that fails; when autovacuum is off it vacuums at once, then every
// DefaultEvery rows.
func TestAutoVacuumsWithoutAutovacuum(t *testing.T) {
	db := newFakeDB(errors.New("connection refused"), false)
	v := New(db, quiet(), "test relay", 0)
	start(t, v)
	if n := vacuums(db, 10*time.Second, 1); n != 1 { // the first answer after a backoff of about a second
		t.Fatalf("at start: %d vacuums, want 1", n)
	}
	waitDecided(t, v)
	v.Counted(DefaultEvery - 1)
	if n := vacuums(db, 100*time.Millisecond, 0); n != 0 {
		t.Fatalf("%d rows: %d vacuums, want 0", DefaultEvery-1, n)
	}
	v.Counted(1)
	if n := vacuums(db, 10*time.Second, 1); n != 1 {
		t.Fatalf("%d rows: %d vacuums, want 1", DefaultEvery, n)
	}
	if asked, unwanted := db.questions(); asked != 2 || len(unwanted) > 0 {
		t.Fatalf("asked %d times, want 2 (one failure, one answer); ran %q", asked, unwanted)
	}
}

// In auto mode with autovacuum on, and with -1, Run returns and never
// vacuums.
func TestNoVacuumWithAutovacuumOrNever(t *testing.T) {
	for name, v := range map[string]*Vacuumer{
		"autovacuum on": New(newFakeDB(true), quiet(), "test relay", 0),
		"never":         New(newFakeDB(errors.New("not asked")), quiet(), "test relay", -1),
	} {
		t.Run(name, func(t *testing.T) {
			select {
			case <-start(t, v):
			case <-time.After(10 * time.Second):
				t.Fatal("Run did not return")
			}
			v.Counted(1_000_000)
			if n := vacuums(v.db.(*fakeDB), 100*time.Millisecond, 0); n != 0 {
				t.Fatalf("%d vacuums, want 0", n)
			}
		})
	}
}
