package mongodb

import "go.mongodb.org/mongo-driver/v2/mongo"

// Collection is the part of a collection the store uses.
type Collection = collection

// NewWrapped returns a Store whose event collection is wrapped by wrap.
func NewWrapped(db *mongo.Database, wrap func(Collection) Collection) *Store {
	s, _ := New(db, "")
	s.events = wrap(s.events)
	return s
}
