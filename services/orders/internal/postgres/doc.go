// Package postgres stores orders in PostgreSQL and writes their events to the
// outbox in the same transaction.
//
// The store's SQL is in queries.sql; sqlc generates package ordersdb from it
// and schema.sql (sqlc.yaml, pgx/v5). Store runs the generated queries on its
// transaction with Queries.WithTx, and outbox.Writer writes the event on the
// same pgx.Tx, so the order and its event commit or roll back together:
//
//	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
//		q := queries.WithTx(tx) // the generated queries, on tx
//		row, err := q.CancelOrder(ctx, id)
//		if err != nil {
//			return err
//		}
//		payload, err := order.CancelledEvent(fromRow(row))
//		if err != nil {
//			return err
//		}
//		// The event, on the same tx: an error rolls back the order's change too.
//		_, err = writer.Enqueue(ctx, tx, outbox.Message{
//			AggregateType: "order", AggregateID: row.ID.String(),
//			EventType: "order.cancelled", Payload: payload,
//		})
//		return err
//	})
//
// Create saves a round trip: the generated InsertOrder is queued, not run,
// into a pgx.Batch (a batchQueue stands in for the connection), the outbox's
// Writer.Queue adds the event to the same batch, and tx.SendBatch sends both.
//
// After editing queries.sql, schema.sql or sqlc.yaml, run `make generate`
// (the pinned sqlc release through go run, then the checksums in
// ordersdb/sqlc.sum); TestGeneratedQueriesAreCurrent fails until then.
//
// Orders are read and locked by primary key: Get and Cancel parse the id into
// a UUID first (an id that is not one is order.ErrNotFound, without a query),
// so their cost does not grow with the table.
package postgres
