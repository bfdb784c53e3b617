-- name: InsertOrder :exec
-- Store.Create queues it into one batch with the order.created event (the
-- outbox's statements are not here: outbox.Writer writes them on the same
-- transaction).
INSERT INTO orders (id, customer_id, currency, items, total, status, version, created_at, updated_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $8);

-- name: GetOrder :one
-- Finds the order through the primary key.
SELECT * FROM orders WHERE id = $1;

-- name: LockOrder :one
-- Cancel and Amend lock the order first, so concurrent cancels produce one
-- event, and concurrent amendments one version each.
SELECT * FROM orders WHERE id = $1 FOR UPDATE;

-- name: CancelOrder :one
-- Cancels a created order and returns it as it now is.
UPDATE orders SET status = 'cancelled', version = version + 1, updated_at = now()
WHERE id = $1
RETURNING *;

-- name: ClaimIdempotencyKey :one
-- Waits on a concurrent transaction holding the same key, so exactly one
-- request creates the order. No row: the key was taken.
INSERT INTO idempotency_keys (key, request_hash, order_id)
VALUES ($1, $2, gen_random_uuid())
ON CONFLICT (key) DO NOTHING
RETURNING order_id;

-- name: GetIdempotencyKey :one
-- A new statement, whose snapshot sees the commit of the transaction that
-- took the key.
SELECT request_hash, order_id FROM idempotency_keys WHERE key = $1;

-- name: AmendOrder :one
-- Gives a created order its next version with the amendment's note, and
-- returns it as it now is.
UPDATE orders SET note = $2, version = version + 1, updated_at = now()
WHERE id = $1
RETURNING *;

-- name: InsertAmendment :exec
-- Records the amendment under its Idempotency-Key, in the transaction that
-- made its version.
INSERT INTO order_amendments (order_id, idempotency_key, request_hash, version, note, created_at)
VALUES ($1, $2, $3, $4, $5, $6);

-- name: GetAmendment :one
-- Finds an amendment by its key, through the primary key. Run after
-- LockOrder: a new statement, whose snapshot sees the commit of a concurrent
-- transaction with the same key that held the lock before.
SELECT version, request_hash, note, created_at FROM order_amendments
WHERE order_id = $1 AND idempotency_key = $2;
