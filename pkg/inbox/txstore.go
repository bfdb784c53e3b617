package inbox

import (
	"context"
	"errors"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"
	"go.mongodb.org/mongo-driver/v2/mongo/readconcern"
	"go.mongodb.org/mongo-driver/v2/mongo/readpref"
	"go.mongodb.org/mongo-driver/v2/mongo/writeconcern"
)

// txStore is what ModeTransaction needs of MongoDB: sessions whose
// transactions read and insert inbox records, and a majority read outside any
// transaction. It is the seam through which the package's tests inject the
// driver's errors (with their real labels and codes) into processTx.
type txStore interface {
	startSession() (txSession, error)
	// readMajority returns the record stored under key as read with read
	// concern majority, outside any transaction: it is there only once a
	// majority of the replica set has it. nil: no record.
	readMajority(ctx context.Context, key string) (*record, error)
}

// txSession is one session, running one transaction at a time.
type txSession interface {
	startTransaction() error
	// context returns ctx carrying the session: operations made with it
	// belong to the session's transaction.
	context(ctx context.Context) context.Context
	// readRecord and insertRecord run in the transaction; ctx comes from
	// context.
	readRecord(ctx context.Context, key string) (*record, error)
	insertRecord(ctx context.Context, doc bson.D) error
	commit(ctx context.Context) error
	abort(ctx context.Context) error
	end(ctx context.Context)
}

// mongoTxStore is txStore on a real client.
type mongoTxStore struct {
	client   *mongo.Client
	coll     *mongo.Collection // default read concern: in a transaction, the transaction's
	majority *mongo.Collection // read concern majority, for reads outside transactions
}

func newMongoTxStore(coll *mongo.Collection) *mongoTxStore {
	return &mongoTxStore{
		client: coll.Database().Client(),
		coll:   coll,
		majority: coll.Database().Collection(coll.Name(),
			options.Collection().SetReadConcern(readconcern.Majority()).SetReadPreference(readpref.Primary())),
	}
}

// txOptions: a snapshot of majority-committed data, committed with majority
// write concern (without it, "snapshot" does not promise majority-committed
// reads) and j: true, so that the commit is acknowledged only once it is in
// the journal of a majority, whatever the server's
// writeConcernMajorityJournalDefault says. The read preference is primary
// whatever the client's is (a readPreference in MONGO_URI): the server
// rejects a transaction whose operations go to a secondary.
var txOptions = options.Transaction().
	SetReadConcern(readconcern.Snapshot()).
	SetWriteConcern(&writeconcern.WriteConcern{W: "majority", Journal: &journaled}).
	SetReadPreference(readpref.Primary())

var journaled = true

func (s *mongoTxStore) startSession() (txSession, error) {
	sess, err := s.client.StartSession()
	if err != nil {
		return nil, err
	}
	return &mongoTxSession{sess: sess, coll: s.coll}, nil
}

func (s *mongoTxStore) readMajority(ctx context.Context, key string) (*record, error) {
	return findRecord(ctx, s.majority, key)
}

func findRecord(ctx context.Context, coll *mongo.Collection, key string) (*record, error) {
	var rec record
	err := coll.FindOne(ctx, bson.D{{Key: "_id", Value: key}}).Decode(&rec)
	if errors.Is(err, mongo.ErrNoDocuments) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	return &rec, nil
}

type mongoTxSession struct {
	sess *mongo.Session
	coll *mongo.Collection
}

func (s *mongoTxSession) startTransaction() error { return s.sess.StartTransaction(txOptions) }

func (s *mongoTxSession) context(ctx context.Context) context.Context {
	return mongo.NewSessionContext(ctx, s.sess)
}

func (s *mongoTxSession) readRecord(ctx context.Context, key string) (*record, error) {
	return findRecord(ctx, s.coll, key)
}

func (s *mongoTxSession) insertRecord(ctx context.Context, doc bson.D) error {
	_, err := s.coll.InsertOne(ctx, doc)
	return err
}

func (s *mongoTxSession) commit(ctx context.Context) error { return s.sess.CommitTransaction(ctx) }
func (s *mongoTxSession) abort(ctx context.Context) error  { return s.sess.AbortTransaction(ctx) }
func (s *mongoTxSession) end(ctx context.Context)          { s.sess.EndSession(ctx) }
