package outboxwal

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// The stream delivers a transaction once its commit record is flushed, which
// is before other sessions can see it: the committing backend then still has
// to wait for synchronous standbys (synchronous_standby_names), and only then
// leaves the set of running transactions. Until it does, its rows are
// invisible: a lookup would take them for gone, and an event published then
// would describe a change that a failover at that moment can still undo (the
// standby never got it, the client never got its answer). So nothing is
// published, swept, handed over or looked up for a transaction until a
// snapshot taken since shows it committed.
//
// A snapshot is cheap to take (no lock table scan) and answers for every
// transaction at once: one query per batch, and none for transactions
// already seen visible.

// snapshotSQL takes a snapshot and names the server it was taken on.
const snapshotSQL = `SELECT pg_current_snapshot()::text, ` + serverSQL

// snapshot is pg_current_snapshot(): transactions below xmin are finished,
// those at or above xmax had not finished when it was taken, and of those in
// between, the ones in xip were still running.
type snapshot struct {
	xmin, xmax uint64
	xip        map[uint64]bool
}

// parseSnapshot reads pg_snapshot's text form, "xmin:xmax:xip,xip,...".
func parseSnapshot(text string) (snapshot, error) {
	parts := strings.Split(text, ":")
	if len(parts) != 3 {
		return snapshot{}, fmt.Errorf("snapshot %q: want xmin:xmax:xip", text)
	}
	var s snapshot
	var err error
	if s.xmin, err = strconv.ParseUint(parts[0], 10, 64); err != nil {
		return snapshot{}, fmt.Errorf("snapshot %q: %w", text, err)
	}
	if s.xmax, err = strconv.ParseUint(parts[1], 10, 64); err != nil {
		return snapshot{}, fmt.Errorf("snapshot %q: %w", text, err)
	}
	s.xip = map[uint64]bool{}
	if parts[2] != "" {
		for _, x := range strings.Split(parts[2], ",") {
			v, err := strconv.ParseUint(x, 10, 64)
			if err != nil {
				return snapshot{}, fmt.Errorf("snapshot %q: %w", text, err)
			}
			s.xip[v] = true
		}
	}
	return s, nil
}

// full widens a 32-bit xid (what the stream gives) to the 64-bit id of the
// most recent transaction with those low bits at or before xmax: the stream's
// transactions are recent, far less than 2^31 transactions behind.
func (s snapshot) full(xid uint32) uint64 {
	f := s.xmax&^0xFFFFFFFF | uint64(xid)
	if f > s.xmax && f >= 1<<32 {
		f -= 1 << 32
	}
	return f
}

// committed says the transaction xid had finished when s was taken. The
// stream only delivers committed transactions, so finished means committed
// and visible to every later snapshot.
func (s snapshot) committed(xid uint32) bool {
	f := s.full(xid)
	return f < s.xmin || (f < s.xmax && !s.xip[f])
}

// notVisible returns the events of evs whose transaction other sessions
// cannot see yet, and marks the transactions of the others visible. It
// takes a snapshot only when some transaction is not known visible yet, on
// the server of the fence: errFenced when the pool reaches another one.
func notVisible(ctx context.Context, db outbox.DB, f fence, evs []*event) ([]*event, error) {
	var unknown []*event
	for _, ev := range evs {
		if !ev.tx.visible.Load() {
			unknown = append(unknown, ev)
		}
	}
	if len(unknown) == 0 {
		return nil, nil
	}
	var text, server string
	if err := db.QueryRow(ctx, snapshotSQL).Scan(&text, &server); err != nil {
		return nil, fmt.Errorf("take a snapshot: %w", err)
	}
	if server != f.server {
		return nil, errFenced
	}
	s, err := parseSnapshot(text)
	if err != nil {
		return nil, err
	}
	var out []*event
	for _, ev := range unknown {
		if s.committed(ev.tx.xid) {
			ev.tx.visible.Store(true)
		} else {
			out = append(out, ev)
		}
	}
	return out, nil
}
