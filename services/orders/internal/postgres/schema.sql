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
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- A client's retry with the same Idempotency-Key finds the order it created.
-- request_hash tells a retry from a reuse of the key for another request. The
-- key is claimed before the order exists, hence the deferred foreign key.
CREATE TABLE IF NOT EXISTS idempotency_keys (
    key          text        PRIMARY KEY,
    request_hash bytea       NOT NULL,
    order_id     uuid        NOT NULL REFERENCES orders (id) DEFERRABLE INITIALLY DEFERRED,
    created_at   timestamptz NOT NULL DEFAULT now()
);
