-- The orders service's own tables. The outbox tables come from pkg/outbox.

CREATE TABLE IF NOT EXISTS orders (
    id          uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    customer_id text        NOT NULL,
    currency    text        NOT NULL,
    items       jsonb       NOT NULL,
    total       bigint      NOT NULL CHECK (total > 0),
    status      text        NOT NULL CHECK (status IN ('created', 'cancelled')),
    version     bigint      NOT NULL DEFAULT 1,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    note        text        NOT NULL DEFAULT ''
);

-- The note of an order's last amendment came with the amendments: a table of
-- an earlier schema gets the column here. Checked first, so that a migration
-- of a table that has it (every run after the first) takes no lock on it:
-- ALTER TABLE ... ADD COLUMN IF NOT EXISTS would take an ACCESS EXCLUSIVE
-- lock, queued behind every open transaction on orders, even to do nothing.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_attribute
                   WHERE attrelid = 'orders'::regclass AND attname = 'note' AND NOT attisdropped) THEN
        ALTER TABLE orders ADD COLUMN note text NOT NULL DEFAULT '';
    END IF;
END
$$;

-- A client's retry with the same Idempotency-Key finds the order it created.
-- request_hash tells a retry from a reuse of the key for another request. The
-- key is claimed before the order exists, hence the deferred foreign key.
CREATE TABLE IF NOT EXISTS idempotency_keys (
    key          text        PRIMARY KEY,
    request_hash bytea       NOT NULL,
    order_id     uuid        NOT NULL REFERENCES orders (id) DEFERRABLE INITIALLY DEFERRED,
    created_at   timestamptz NOT NULL DEFAULT now()
);

-- Each amendment of an order, under the Idempotency-Key its client sent: a
-- retry finds the version the first attempt made instead of making another.
-- request_hash tells a retry from a reuse of the key for another note.
CREATE TABLE IF NOT EXISTS order_amendments (
    order_id        uuid        NOT NULL REFERENCES orders (id),
    idempotency_key text        NOT NULL,
    request_hash    bytea       NOT NULL,
    version         bigint      NOT NULL,
    note            text        NOT NULL,
    created_at      timestamptz NOT NULL,
    PRIMARY KEY (order_id, idempotency_key),
    UNIQUE (order_id, version)
);
