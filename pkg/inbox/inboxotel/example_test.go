package inboxotel_test

import (
	"context"

	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.opentelemetry.io/otel/trace"

	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/pkg/inbox/inboxotel"
)

// A consumer traces its inbox: the check and the record through the hooks,
// the effect by wrapping the handler. ctx carries the delivery's process
// span (whose parent the consumer extracted from the message's headers).
func Example() {
	var (
		db       *mongo.Database      // the consumer's database
		provider trace.TracerProvider // from the application's SDK setup
		ctx      context.Context      // carries the delivery's process span
		msgID    string               // the message's id
	)
	if db == nil {
		return // the wiring below, shown without a server
	}
	tr := inboxotel.New(provider)
	in, err := inbox.New(db, inbox.Config{Consumer: "shipping", Hooks: tr.Hooks()})
	if err != nil {
		return
	}
	res, err := in.Process(ctx, msgID, tr.Handler("apply shipment", func(ctx context.Context) error {
		return nil // the effect, with this ctx
	}))
	_, _ = res, err // ack when err == nil; res == inbox.Duplicate: the check span has inbox.duplicate=true
	// Output:
}
