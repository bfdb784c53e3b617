package inbox

import (
	"context"
	"errors"
	"sync"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
)

// fakeTx is a txStore in memory that behaves, where processTx can tell, like
// a replica set: a transaction reads a snapshot of majority-committed
// records, an insert of a key the primary has (majority-committed or not)
// fails with a duplicate key, and each operation can be made to fail with a
// scripted driver error carrying the server's labels and codes.
type fakeTx struct {
	mu sync.Mutex
	// majority holds the records a majority has; local those only the
	// primary has (committed there, not yet majority-committed).
	majority map[string]*record
	local    map[string]*record
	// script holds, per operation, the errors its next calls return (a nil
	// entry lets that call through); hooks run before an operation (with the
	// 1-based call number) and may change the state.
	script map[string][]error
	hooks  map[string]func(call int)
	calls  map[string]int
	// applyOnFail: operations whose scripted error is returned after the
	// operation took effect (a commit whose reply was lost).
	applyOnFail map[string]bool
}

// Operations of fakeTx, as named in its script, hooks and calls.
const (
	opStart    = "startTransaction"
	opRead     = "readRecord"
	opInsert   = "insertRecord"
	opCommit   = "commit"
	opAbort    = "abort"
	opMajority = "readMajority"
	opSession  = "startSession"
)

func newFakeTx() *fakeTx {
	return &fakeTx{
		majority:    map[string]*record{},
		local:       map[string]*record{},
		script:      map[string][]error{},
		hooks:       map[string]func(int){},
		calls:       map[string]int{},
		applyOnFail: map[string]bool{},
	}
}

// fail makes the next calls of op return errs, in order.
func (f *fakeTx) fail(op string, errs ...error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.script[op] = append(f.script[op], errs...)
}

// failAlways makes every call of op return err.
func (f *fakeTx) failAlways(op string, err error) {
	f.hook(op, func(int) { f.script[op] = []error{err} })
}

func (f *fakeTx) hook(op string, h func(call int)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.hooks[op] = h
}

func (f *fakeTx) count(op string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls[op]
}

// enter counts a call of op, runs its hook and pops its scripted error. The
// caller holds f.mu.
func (f *fakeTx) enter(op string) error {
	f.calls[op]++
	if h := f.hooks[op]; h != nil {
		h(f.calls[op])
	}
	if len(f.script[op]) == 0 {
		return nil
	}
	err := f.script[op][0]
	f.script[op] = f.script[op][1:]
	return err
}

func (f *fakeTx) startSession() (txSession, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enter(opSession); err != nil {
		return nil, err
	}
	return &fakeSession{f: f}, nil
}

func (f *fakeTx) readMajority(ctx context.Context, key string) (*record, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enter(opMajority); err != nil {
		return nil, err
	}
	if ctx.Value(fakeSessionKey{}) != nil {
		return nil, errors.New("fake: majority read made inside the transaction")
	}
	if r := f.majority[key]; r != nil {
		c := *r
		return &c, nil
	}
	return nil, nil
}

type fakeSessionKey struct{}

// fakeSession runs one transaction at a time; its writes are staged until
// commit.
type fakeSession struct {
	f         *fakeTx
	open      bool
	committed bool // the current transaction's commit was called
	staged    map[string]*record
}

func (s *fakeSession) startTransaction() error {
	s.f.mu.Lock()
	defer s.f.mu.Unlock()
	if err := s.f.enter(opStart); err != nil {
		return err
	}
	if s.open {
		return errors.New("fake: transaction already in progress")
	}
	// A transaction whose commit failed with NoSuchTransaction is gone.
	s.open, s.committed, s.staged = true, false, map[string]*record{}
	return nil
}

func (s *fakeSession) context(ctx context.Context) context.Context {
	return context.WithValue(ctx, fakeSessionKey{}, s)
}

func (s *fakeSession) inTx(ctx context.Context) error {
	if ctx.Value(fakeSessionKey{}) != s {
		return errors.New("fake: operation outside the session's context")
	}
	if !s.open {
		return errNoSuchTransaction
	}
	return nil
}

func (s *fakeSession) readRecord(ctx context.Context, key string) (*record, error) {
	s.f.mu.Lock()
	defer s.f.mu.Unlock()
	if err := s.f.enter(opRead); err != nil {
		return nil, err
	}
	if err := s.inTx(ctx); err != nil {
		return nil, err
	}
	if r := s.staged[key]; r != nil {
		return r, nil
	}
	if r := s.f.majority[key]; r != nil { // the snapshot: majority-committed data
		c := *r
		return &c, nil
	}
	return nil, nil
}

func (s *fakeSession) insertRecord(ctx context.Context, doc bson.D) error {
	s.f.mu.Lock()
	defer s.f.mu.Unlock()
	if err := s.f.enter(opInsert); err != nil {
		s.open = false // a write error aborts the transaction on the server
		return err
	}
	if err := s.inTx(ctx); err != nil {
		return err
	}
	var key, state string
	for _, e := range doc {
		switch e.Key {
		case "_id":
			key = e.Value.(string)
		case "state":
			state = e.Value.(string)
		}
	}
	if s.f.majority[key] != nil || s.f.local[key] != nil || s.staged[key] != nil {
		s.open = false
		return errDuplicateKey
	}
	s.staged[key] = &record{State: state}
	return nil
}

func (s *fakeSession) commit(context.Context) error {
	s.f.mu.Lock()
	defer s.f.mu.Unlock()
	err := s.f.enter(opCommit)
	if err == nil || s.f.applyOnFail[opCommit] {
		for k, r := range s.staged {
			s.f.majority[k] = r
		}
		s.staged = nil
	}
	// After a commit, failed or not, no operation joins the transaction;
	// committing it again applies what is staged (a commit is idempotent
	// on the server), and a new transaction drops it.
	s.open, s.committed = false, true
	return err
}

func (s *fakeSession) abort(context.Context) error {
	s.f.mu.Lock()
	defer s.f.mu.Unlock()
	err := s.f.enter(opAbort)
	if s.committed { // as the driver says
		return errors.New("fake: cannot call abortTransaction after calling commitTransaction")
	}
	s.open, s.staged = false, nil
	return err
}

func (s *fakeSession) end(context.Context) {}

// Driver errors as the server and the driver produce them.
var (
	errWriteConflict = mongo.CommandError{
		Code: 112, Name: "WriteConflict",
		Message: "Caused by :: Write conflict during plan execution and yielding is disabled. :: Please retry your operation or multi-document transaction.",
		Labels:  []string{labelTransient},
	}
	errNoSuchTransaction = mongo.CommandError{
		Code: 251, Name: "NoSuchTransaction",
		Message: "Transaction with { txnNumber: 2 } has been aborted.",
		Labels:  []string{labelTransient},
	}
	errUnknownCommit = mongo.CommandError{
		Code: 189, Name: "PrimarySteppedDown",
		Message: "Primary stepped down while waiting for replication",
		Labels:  []string{labelUnknownCommit, "RetryableWriteError"},
	}
	errDuplicateKey = mongo.WriteException{WriteErrors: []mongo.WriteError{{
		Index: 0, Code: 11000,
		Message: "E11000 duplicate key error collection: db.inbox index: _id_ dup key: { _id: \"test/m-1\" }",
	}}}
	errUnauthorized = mongo.CommandError{Code: 13, Name: "Unauthorized", Message: "not authorized"}
)

// times repeats err n times.
func times(n int, err error) []error {
	out := make([]error, n)
	for i := range out {
		out[i] = err
	}
	return out
}
