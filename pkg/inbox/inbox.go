package inbox

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"
	"go.mongodb.org/mongo-driver/v2/mongo/writeconcern"
)

// Mode selects how Process makes the handler's effect and the inbox record
// one unit. See the package documentation for each mode's guarantee.
type Mode string

const (
	// ModeAuto asks the server once (hello): a replica set member or a mongos
	// gets ModeTransaction, anything else (a standalone server, FerretDB)
	// gets ModeStandalone.
	ModeAuto Mode = "auto"
	// ModeTransaction commits the inbox record and the handler's writes in one
	// multi-document transaction. Needs a replica set or a sharded cluster.
	ModeTransaction Mode = "transaction"
	// ModeStandalone runs without transactions: the handler first, the record
	// after it. The handler's effect must be idempotent on its own key.
	ModeStandalone Mode = "standalone"
)

// Result says what Process did with a message.
type Result int

const (
	// Processed: the handler ran and returned nil, and the message is
	// recorded as done (with FlushInterval: its record is buffered, and
	// written shortly after).
	Processed Result = iota + 1
	// Duplicate: the message was already recorded as done; the handler did
	// not run.
	Duplicate
	// AlreadyApplied (Gate only): the gate had the message's version
	// applied by this message, the inbox no record of it; the handler did
	// not run, and the message is recorded now.
	AlreadyApplied
)

func (r Result) String() string {
	switch r {
	case Processed:
		return "processed"
	case Duplicate:
		return "duplicate"
	case AlreadyApplied:
		return "already applied"
	default:
		return fmt.Sprintf("Result(%d)", int(r))
	}
}

var (
	// ErrInvalidMessageID is returned for an empty, oversized or non-UTF-8
	// message id. Nothing is written and the handler does not run: a message
	// that cannot be deduplicated must not be processed (dead-letter it).
	ErrInvalidMessageID = errors.New("inbox: invalid message id")
	// ErrInProgress is returned in ModeStandalone with a Lease when another
	// consumer holds a live claim on the message: it is being processed right
	// now, or its claimer died less than a Lease ago. Retry later; the
	// handler did not run.
	ErrInProgress = errors.New("inbox: message is being processed by another consumer")
	// ErrHandler wraps the error the handler returned. No record was kept, so
	// a redelivery runs the handler again.
	ErrHandler = errors.New("inbox: handler failed")
	// ErrBeyondHorizon is returned when the message was created longer ago
	// than the inbox keeps records (Config.MessageTime) and no record of it
	// is left: it may have been applied already, and the inbox can no
	// longer tell. The handler did not run and nothing was recorded. Park or
	// dead-letter the message with this reason for an operator, who knows
	// whether its effect is there.
	ErrBeyondHorizon = errors.New("inbox: message older than the inbox's retention")
)

// Handler applies a message's effect. It must do its database work with the
// ctx it is given: in ModeTransaction that context carries the session, and
// only writes made with it commit together with the inbox record.
type Handler func(ctx context.Context) error

// Config configures an Inbox. The zero value of every field but Consumer
// means its default; New refuses values out of range and settings of the
// other mode (Standalone with ModeTransaction, Transaction with
// ModeStandalone).
type Config struct {
	// Consumer names the consumer: the same message id is deduplicated
	// separately for each consumer name, so two services can share the
	// collection. Required.
	Consumer string
	// Collection holds the inbox records. Default: DefaultCollection.
	Collection string
	// Retention is how long a done record is kept, and so how late a
	// redelivery of the same message is still recognised as a duplicate. It
	// must exceed the longest delay after which the producer may deliver a
	// message again (see the package documentation). Default:
	// DefaultRetention (7 days).
	Retention time.Duration
	// MessageTime, when set, reads the time a message was created from its
	// id (for the ids of pkg/outbox, the creation time outbox.ParseMessageID
	// returns), and gives the inbox a dedup horizon. The inbox recognises a
	// message only while it holds its record, which expires Retention after
	// it was written, so a message created longer ago than that may have been
	// applied and forgotten: Process refuses it with ErrBeyondHorizon (a
	// Duplicate if its record is still there) instead of applying it a second
	// time. The horizon is 99% of Retention: the margin (100 minutes for 7
	// days) absorbs the producer's clock and the consumer's disagreeing.
	// Return false for an id without a time: it has no horizon. Default: nil,
	// no horizon (a message redelivered after its record expired is applied
	// again, unless the handler guards its effect).
	MessageTime func(msgID string) (time.Time, bool)
	// TallyBucket, when set (with MessageTime), makes the inbox count the
	// messages it records done per bucket of this width of their creation
	// time, with a digest of their ids (Tally), for a loss audit: see
	// Tallies. It costs a write per record written (per flush and bucket
	// with FlushInterval). Default: 0, no tallies.
	TallyBucket time.Duration
	// Mode is ModeAuto, ModeTransaction or ModeStandalone. Default: ModeAuto.
	Mode Mode
	// Standalone configures ModeStandalone: it applies when Mode is
	// ModeStandalone, or ModeAuto that finds no transactions. In
	// ModeTransaction the record commits with the effect and none of it has
	// a meaning: New refuses it with ModeTransaction.
	Standalone StandaloneConfig
	// Transaction configures ModeTransaction: it applies when Mode is
	// ModeTransaction, or ModeAuto that finds a replica set or a mongos. New
	// refuses it with ModeStandalone.
	Transaction TransactionConfig
	// DoneCacheSize bounds the in-process cache of message ids this Inbox
	// knows are done (recorded, buffered, or found done by a lookup), which
	// Process consults before anything else: a hit is a Duplicate without a
	// database operation. When full, the oldest id is evicted. Done is final,
	// so a hit is always right, also after retention purged the record; a
	// miss costs the usual lookup. Each entry holds the message id (a few
	// dozen bytes for a UUID). Default: DefaultDoneCacheSize entries; -1
	// disables.
	DoneCacheSize int
	// Logger receives the inbox's logs (among them failed writes of
	// buffered records, with "message_id", "error" and "attempt").
	// Default: discard.
	Logger *slog.Logger
	// Hooks observe each Process call's steps (the check, the record), for
	// tracing or metrics; see Hooks. Default: none.
	Hooks Hooks
}

// StandaloneConfig configures ModeStandalone (see Config.Standalone). Lease
// and FlushInterval exclude each other: a claim is turned into done
// synchronously. With neither, each record is written before Process
// returns.
type StandaloneConfig struct {
	// Lease makes Process claim a message before running its handler, so a
	// concurrent duplicate gets ErrInProgress instead of running the
	// handler at the same time; a claim whose holder died is taken over
	// once Lease has passed. Set it above the handler's longest run, and at
	// most Retention. Default: 0, no claim: concurrent duplicates may both
	// run the (idempotent) handler, and recovery after a crash is immediate.
	Lease time.Duration
	// FlushInterval makes Process buffer the done record of a message whose
	// handler succeeded and return, instead of writing the record first: a
	// background flusher writes the buffer with one unordered InsertMany
	// every FlushInterval, or as soon as FlushBatch records wait. IsDone and
	// Process see buffered records. Call Close before exiting: records still
	// buffered when the process dies are lost, which costs a rerun of the
	// idempotent handler on a redelivery, never a lost or doubled effect
	// (see the package documentation). Default: 0, each record is written
	// before Process returns.
	FlushInterval time.Duration
	// FlushBatch is, with FlushInterval, how many buffered records trigger a
	// flush before FlushInterval has passed, and the most one InsertMany
	// writes. Refused without FlushInterval. Default: DefaultFlushBatch.
	FlushBatch int
	// MaxBufferedRecords bounds, with FlushInterval, how many records the
	// buffer holds. When it is full (flushes keep failing, or fall behind),
	// Process writes its message's record itself before it returns, as
	// without FlushInterval: while the database fails, Process fails (do not
	// ack), which holds the consumer back instead of growing the buffer.
	// Refused without FlushInterval. Default: 16 × FlushBatch.
	MaxBufferedRecords int
}

// TransactionConfig configures ModeTransaction (see Config.Transaction).
type TransactionConfig struct {
	// RetryBudget bounds how long Process retries a message through
	// transient errors: write conflicts (TransientTransactionError) with a
	// concurrent duplicate or with an orphaned transaction of a dead
	// consumer holding the record, a failover, a commit whose outcome is
	// unknown (UnknownTransactionCommitResult, committed again), a duplicate
	// key on a record a majority does not have yet. Retries pause 10ms
	// doubling to 1s. When the budget runs out, Process returns a
	// *TransientError (errors.Is ErrTransient), which is not a handler
	// failure: retry the message later. Keep it above the server's
	// transactionLifetimeLimitSeconds (60s by default), after which the
	// server aborts an orphaned transaction. Default: DefaultRetryBudget
	// (90s).
	RetryBudget time.Duration
	// MaxAttempts, if set, also bounds how many transactions Process tries
	// for one message before it returns a *TransientError; re-commits of a
	// commit whose outcome is unknown are bounded by RetryBudget only.
	// Default: 0, no bound but the budget.
	MaxAttempts int
}

// Defaults of Config: the value a zero field means.
const (
	DefaultCollection    = "inbox"
	DefaultRetention     = 7 * 24 * time.Hour
	DefaultDoneCacheSize = 10_000
	DefaultFlushBatch    = 256
	// DefaultRetryBudget is longer than the server's default
	// transactionLifetimeLimitSeconds (60s), after which an orphaned
	// transaction holding the record is aborted.
	DefaultRetryBudget = 90 * time.Second
)

// Maximum length of a message id, in bytes.
const maxMessageIDLen = 1024

// Inbox deduplicates messages by id for one consumer. It is safe for
// concurrent use. An Inbox configured with FlushInterval runs a goroutine
// once it has buffered a record: Close it.
type Inbox struct {
	db          *mongo.Database
	coll        *mongo.Collection
	consumer    string
	retention   time.Duration
	messageTime func(msgID string) (time.Time, bool)
	tallyBucket time.Duration
	tallies     *mongo.Collection // Config.TallyBucket's, or nil
	lease       time.Duration
	maxAttempts int
	log         *slog.Logger
	cache       *doneCache    // nil: disabled
	buf         *recordBuffer // nil: records are written synchronously
	tx          txStore       // ModeTransaction's access to MongoDB
	txBudget    time.Duration
	txBackoff   func(attempt int) time.Duration // pause before a transaction's attempt (or a commit's), attempt >= 2
	hooks       Hooks

	modeMu   sync.Mutex
	mode     Mode                                               // resolved; "" until known
	detect   func(context.Context, *mongo.Client) (Mode, error) // ModeAuto's question to the server
	ttlIndex atomic.Bool
}

// New returns an Inbox storing its records in db. It does not talk to the
// server: ModeAuto is resolved on first use.
func New(db *mongo.Database, cfg Config) (*Inbox, error) {
	if db == nil {
		return nil, errors.New("inbox: nil database")
	}
	if cfg.Consumer == "" || len(cfg.Consumer) > 256 || !utf8.ValidString(cfg.Consumer) || strings.ContainsAny(cfg.Consumer, "/\x00") {
		return nil, fmt.Errorf("inbox: Consumer %q: want 1 to 256 bytes of UTF-8 without NUL or '/'", cfg.Consumer)
	}
	coll := cmp.Or(cfg.Collection, DefaultCollection)
	if err := validCollection(coll); err != nil {
		return nil, fmt.Errorf("inbox: Collection %q: %w", coll, err)
	}
	switch cfg.Mode {
	case "", ModeAuto, ModeTransaction, ModeStandalone:
	default:
		return nil, fmt.Errorf("inbox: Mode %q: want %q, %q or %q", cfg.Mode, ModeAuto, ModeTransaction, ModeStandalone)
	}
	if cfg.Retention < 0 || cfg.Retention > 0 && cfg.Retention < time.Second {
		return nil, fmt.Errorf("inbox: Retention %v: want at least 1s (or 0 for the default)", cfg.Retention)
	}
	if cfg.TallyBucket < 0 || cfg.TallyBucket > 0 && (cfg.MessageTime == nil || cfg.TallyBucket < time.Second) {
		return nil, fmt.Errorf("inbox: TallyBucket %v: want 0 (no tallies), or at least 1s with MessageTime", cfg.TallyBucket)
	}
	if cfg.DoneCacheSize < -1 {
		return nil, fmt.Errorf("inbox: DoneCacheSize %d: want a positive size, 0 for the default or -1 to disable", cfg.DoneCacheSize)
	}
	sa, tx := cfg.Standalone, cfg.Transaction
	if cfg.Mode == ModeTransaction && sa != (StandaloneConfig{}) {
		return nil, errors.New("inbox: Standalone applies to ModeStandalone only: in ModeTransaction the record commits with the effect")
	}
	if cfg.Mode == ModeStandalone && tx != (TransactionConfig{}) {
		return nil, errors.New("inbox: Transaction applies to ModeTransaction only")
	}
	if sa.Lease < 0 {
		return nil, fmt.Errorf("inbox: Standalone.Lease %v: want 0 (no claim) or a positive duration", sa.Lease)
	}
	if sa.FlushInterval < 0 {
		return nil, fmt.Errorf("inbox: Standalone.FlushInterval %v: want 0 (write records synchronously) or a positive duration", sa.FlushInterval)
	}
	if sa.FlushBatch < 0 {
		return nil, fmt.Errorf("inbox: Standalone.FlushBatch %d: want a positive number (or 0 for the default)", sa.FlushBatch)
	}
	if sa.MaxBufferedRecords < 0 {
		return nil, fmt.Errorf("inbox: Standalone.MaxBufferedRecords %d: want a positive number (or 0 for the default)", sa.MaxBufferedRecords)
	}
	if sa.FlushInterval == 0 && (sa.FlushBatch != 0 || sa.MaxBufferedRecords != 0) {
		return nil, errors.New("inbox: Standalone.FlushBatch and MaxBufferedRecords apply only with FlushInterval (buffered records)")
	}
	if sa.FlushInterval > 0 && sa.Lease > 0 {
		return nil, errors.New("inbox: Standalone.FlushInterval and Lease exclude each other: a claim is turned into done synchronously")
	}
	if tx.RetryBudget < 0 {
		return nil, fmt.Errorf("inbox: Transaction.RetryBudget %v: want a positive duration (or 0 for the default)", tx.RetryBudget)
	}
	if tx.MaxAttempts < 0 {
		return nil, fmt.Errorf("inbox: Transaction.MaxAttempts %d: want a positive number (or 0 for the default)", tx.MaxAttempts)
	}
	retention := cmp.Or(cfg.Retention, DefaultRetention)
	if sa.Lease > retention {
		return nil, fmt.Errorf("inbox: Standalone.Lease %v exceeds Retention %v", sa.Lease, retention)
	}
	in := &Inbox{
		db: db,
		// ModeStandalone's record writes wait for the journal: see the
		// package documentation, "Durability".
		coll:        db.Collection(coll, options.Collection().SetWriteConcern(writeconcern.Journaled())),
		tx:          newMongoTxStore(db.Collection(coll)),
		txBudget:    cmp.Or(tx.RetryBudget, DefaultRetryBudget),
		txBackoff:   backoff,
		detect:      detectMode,
		consumer:    cfg.Consumer,
		retention:   retention,
		messageTime: cfg.MessageTime,
		tallyBucket: cfg.TallyBucket,
		lease:       sa.Lease,
		maxAttempts: tx.MaxAttempts,
		log:         cfg.Logger,
		hooks:       cfg.Hooks,
	}
	if cfg.TallyBucket > 0 {
		in.tallies = db.Collection(coll+TallySuffix, options.Collection().SetWriteConcern(writeconcern.Journaled()))
	}
	if cfg.Mode != ModeAuto {
		in.mode = cfg.Mode
	}
	if cfg.DoneCacheSize != -1 {
		in.cache = newDoneCache(cmp.Or(cfg.DoneCacheSize, DefaultDoneCacheSize))
	}
	if sa.FlushInterval > 0 {
		batch := cmp.Or(sa.FlushBatch, DefaultFlushBatch)
		in.buf = newRecordBuffer(sa.FlushInterval, batch, cmp.Or(sa.MaxBufferedRecords, 16*batch))
	}
	if in.log == nil {
		in.log = slog.New(slog.DiscardHandler)
	}
	return in, nil
}

// Collection returns the collection holding the records.
func (in *Inbox) Collection() *mongo.Collection { return in.coll }

// Mode returns the mode Process uses, asking the server the first time when
// the Inbox was configured with ModeAuto.
func (in *Inbox) Mode(ctx context.Context) (Mode, error) {
	in.modeMu.Lock()
	defer in.modeMu.Unlock()
	if in.mode != "" {
		return in.mode, nil
	}
	m, err := in.detect(ctx, in.db.Client())
	if err != nil {
		return "", err
	}
	in.mode = m
	in.log.InfoContext(ctx, "inbox mode detected", "mode", string(m), "consumer", in.consumer)
	return m, nil
}

// detectMode picks ModeTransaction for a replica set member or a mongos that
// is not FerretDB, ModeStandalone otherwise.
func detectMode(ctx context.Context, client *mongo.Client) (Mode, error) {
	admin := client.Database("admin")
	var hello struct {
		SetName string `bson:"setName"`
		Msg     string `bson:"msg"`
	}
	err := admin.RunCommand(ctx, bson.D{{Key: "hello", Value: 1}}).Decode(&hello)
	var se mongo.ServerError
	if errors.As(err, &se) && se.HasErrorCode(59) { // CommandNotFound: before MongoDB 4.4.2
		err = admin.RunCommand(ctx, bson.D{{Key: "isMaster", Value: 1}}).Decode(&hello)
	}
	if err != nil {
		return "", fmt.Errorf("inbox: detect mode: hello: %w", err)
	}
	if hello.SetName == "" && hello.Msg != "isdbgrid" {
		return ModeStandalone, nil
	}
	// FerretDB has no transactions whatever it answers to hello.
	var info bson.M
	if err := admin.RunCommand(ctx, bson.D{{Key: "buildInfo", Value: 1}}).Decode(&info); err != nil {
		return "", fmt.Errorf("inbox: detect mode: buildInfo: %w", err)
	}
	if _, ok := info["ferretdbVersion"]; ok {
		return ModeStandalone, nil
	}
	if _, ok := info["ferretdb"]; ok {
		return ModeStandalone, nil
	}
	return ModeTransaction, nil
}

// Process runs handler for the message msgID unless this consumer has already
// processed it. It returns Processed after the handler returned nil and the
// message was recorded (or its record buffered, with FlushInterval),
// Duplicate when it had been recorded before (the handler did not run; a hit
// in the done cache answers this without a database operation), or an
// error:
//
//   - ErrInvalidMessageID: msgID cannot be a key; nothing ran.
//   - ErrInProgress (ModeStandalone with a Lease): another consumer holds a
//     live claim; nothing ran. Retry later.
//   - ErrHandler wrapping the handler's error: no record was kept (in
//     ModeTransaction the handler's writes were rolled back too). In
//     ModeTransaction also when the server aborted the transaction under
//     the handler several times in a row, or in every attempt the retry
//     budget allowed (NoSuchTransaction at the commit of a handler that
//     returned nil, or from the handler itself): it swallowed
//     a write error, or outlived the transaction (see the package
//     documentation).
//   - ErrTransient (a *TransientError), ModeTransaction only: transient
//     errors outlasted Config.Transaction.RetryBudget (an orphaned
//     transaction holds the record, a failover, a commit outcome still
//     unknown). Not a handler failure: retry later, do not count it.
//   - any other error: the database failed. In ModeStandalone the handler
//     may have run; a retry runs it again, which its idempotence absorbs.
//
// Acknowledge the message to the broker only after Process returned
// Processed or Duplicate.
func (in *Inbox) Process(ctx context.Context, msgID string, handler Handler) (Result, error) {
	if err := validMessageID(msgID); err != nil {
		return 0, err
	}
	if handler == nil {
		return 0, errors.New("inbox: nil handler")
	}
	if !mutantInboxNoDedup && in.cache.contains(msgID) {
		if in.hooks.StartStep != nil || in.hooks.EndStep != nil {
			in.endStep(in.startStep(ctx, StepCheck, msgID), StepCheck, msgID, StepResult{Duplicate: true, Cached: true})
		}
		return Duplicate, nil
	}
	if beyond, res, err := in.beyondHorizon(ctx, msgID); beyond {
		return res, err
	}
	mode, err := in.Mode(ctx)
	if err != nil {
		return 0, err
	}
	if mode == ModeTransaction {
		return in.processTx(ctx, msgID, handler)
	}
	if in.lease > 0 {
		return in.processClaimed(ctx, msgID, handler)
	}
	return in.processStandalone(ctx, msgID, handler)
}

// beyondHorizon settles a message created longer ago than the horizon
// (Config.MessageTime): a Duplicate if its record is still there, else
// ErrBeyondHorizon. beyond is false for every other message.
func (in *Inbox) beyondHorizon(ctx context.Context, msgID string) (beyond bool, res Result, err error) {
	if in.messageTime == nil {
		return false, 0, nil
	}
	created, ok := in.messageTime(msgID)
	if !ok {
		return false, 0, nil
	}
	age := time.Since(created)
	if age <= in.retention-in.retention/100 {
		return false, 0, nil
	}
	done, err := in.IsDone(ctx, msgID)
	switch {
	case err != nil:
		return true, 0, err
	case done:
		in.cache.add(msgID)
		return true, Duplicate, nil
	}
	return true, 0, fmt.Errorf("%w: message %s was created %v ago, records are kept %v", ErrBeyondHorizon, msgID, age.Round(time.Second), in.retention)
}

func validCollection(name string) error {
	if strings.ContainsAny(name, "$\x00") || strings.HasPrefix(name, ".") || strings.HasPrefix(name, "system.") || len(name) > 200 || !utf8.ValidString(name) {
		return errors.New("not a valid collection name")
	}
	return nil
}

func validMessageID(id string) error {
	switch {
	case id == "":
		return fmt.Errorf("%w: empty", ErrInvalidMessageID)
	case len(id) > maxMessageIDLen:
		return fmt.Errorf("%w: %d bytes, want at most %d", ErrInvalidMessageID, len(id), maxMessageIDLen)
	case !utf8.ValidString(id):
		return fmt.Errorf("%w: not valid UTF-8", ErrInvalidMessageID)
	case strings.ContainsRune(id, 0):
		return fmt.Errorf("%w: contains NUL", ErrInvalidMessageID)
	}
	return nil
}

// Record states.
const (
	stateProcessing = "processing"
	stateDone       = "done"
)

// key is a record's _id: "consumer/message id", unambiguous since a consumer
// name has no '/'. A string _id, looked up alone, is the one filter FerretDB's
// SQLite backend pushes down to SQLite instead of filtering every document.
func (in *Inbox) key(msgID string) string { return in.consumer + "/" + msgID }

// byKey is the filter selecting msgID's record.
func (in *Inbox) byKey(msgID string) bson.D { return bson.D{{Key: "_id", Value: in.key(msgID)}} }

// newRecord starts a record document for msgID with fields.
func (in *Inbox) newRecord(msgID string, fields bson.D) bson.D {
	return append(bson.D{
		{Key: "_id", Value: in.key(msgID)},
		{Key: "consumer", Value: in.consumer},
		{Key: "message_id", Value: msgID},
	}, fields...)
}

// doneFields are the fields of a done record processed at now.
func (in *Inbox) doneFields(now time.Time) bson.D {
	return bson.D{
		{Key: "state", Value: stateDone},
		{Key: "processed_at", Value: now},
		{Key: "expire_at", Value: now.Add(in.retention)},
	}
}

// IsDone reports whether this consumer has recorded msgID as done. A record
// in the done cache or still buffered (FlushInterval) counts as done. In
// ModeTransaction the record is read with read concern majority: a record
// only the primary has may still be rolled back by a failover, and is not
// done yet (nor cached).
func (in *Inbox) IsDone(ctx context.Context, msgID string) (bool, error) {
	if err := validMessageID(msgID); err != nil {
		return false, err
	}
	if mutantInboxNoDedup {
		return false, nil // a planted bug: see mutant_inbox_nodedup.go
	}
	if in.cache.contains(msgID) || in.buf.has(msgID) {
		return true, nil
	}
	mode, err := in.Mode(ctx)
	if err != nil {
		return false, err
	}
	var rec *record
	if mode == ModeTransaction {
		if rec, err = in.tx.readMajority(ctx, in.key(msgID)); err != nil {
			err = fmt.Errorf("inbox: read record %s with a majority read: %w", msgID, err)
		}
	} else {
		rec, err = in.read(ctx, msgID)
	}
	if err != nil {
		return false, err
	}
	done := rec != nil && rec.State == stateDone
	if done {
		in.cache.add(msgID)
	}
	return done, nil
}

// record is the part of a record Process reads.
type record struct {
	State      string    `bson:"state"`
	Owner      string    `bson:"owner"`
	LeaseUntil time.Time `bson:"lease_until"`
}

// read returns msgID's record, or nil if there is none.
func (in *Inbox) read(ctx context.Context, msgID string) (*record, error) {
	var rec record
	err := in.coll.FindOne(ctx, in.byKey(msgID)).Decode(&rec)
	if errors.Is(err, mongo.ErrNoDocuments) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("inbox: read record %s: %w", msgID, err)
	}
	return &rec, nil
}

func handlerError(err error) error { return fmt.Errorf("%w: %w", ErrHandler, err) }

func newToken() string {
	b := make([]byte, 12)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
