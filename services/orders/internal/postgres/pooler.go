package postgres

import (
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/services/orders/internal/config"
)

// PoolConfig parses databaseURL for a pool, configured for what sits between
// the service and PostgreSQL (config.Config.DatabasePooler).
//
// Behind a transaction pooler (PgBouncer with pool_mode=transaction) a client
// gets a server connection for one transaction at a time, and server
// connections outlive clients. pgx's default statement cache prepares named
// statements ("stmtcache_" and a hash of the query) on whichever server
// connection runs the query: the next transaction may run on another one,
// which does not have it, and a process started again finds the statements
// its predecessor left, under the same names, and fails with SQLSTATE 42P05
// (prepared statement already exists). So with config.PoolerTransaction the
// pool uses cache_describe: statements are parsed in every round trip as
// unnamed statements, and only their descriptions are cached in the process.
// exec and simple_protocol, when databaseURL asks for them, are kept;
// describe_exec is refused (its second round trip may reach another server
// connection). PgBouncer carries no search_path or options startup
// parameter to the server (1.18 refuses them, or drops them when told to
// ignore them), so a databaseURL that sets one is refused too: set the
// search_path on the role or database instead (ALTER ROLE ... SET
// search_path).
func PoolConfig(databaseURL, pooler string) (*pgxpool.Config, error) {
	cfg, err := pgxpool.ParseConfig(databaseURL)
	if err != nil {
		return nil, fmt.Errorf("parse DATABASE_URL: %w", err)
	}
	switch pooler {
	case config.PoolerNone, "":
		return cfg, nil
	case config.PoolerTransaction:
	default:
		return nil, fmt.Errorf("DATABASE_POOLER=%q: want %s or %s", pooler, config.PoolerNone, config.PoolerTransaction)
	}
	cc := cfg.ConnConfig
	switch cc.DefaultQueryExecMode {
	case pgx.QueryExecModeCacheStatement:
		cc.DefaultQueryExecMode = pgx.QueryExecModeCacheDescribe
	case pgx.QueryExecModeCacheDescribe, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol:
	default:
		return nil, fmt.Errorf("DATABASE_URL: default_query_exec_mode %q does not work behind a transaction pooler (DATABASE_POOLER=%s): use cache_describe, exec or simple_protocol", cc.DefaultQueryExecMode, pooler)
	}
	cc.StatementCacheCapacity = 0
	for _, p := range []string{"search_path", "options"} {
		if _, ok := cc.RuntimeParams[p]; ok {
			return nil, fmt.Errorf("DATABASE_URL sets %s, which a transaction pooler does not carry to PostgreSQL (DATABASE_POOLER=%s): set it on the database role instead (ALTER ROLE ... SET search_path = ...)", p, pooler)
		}
	}
	return cfg, nil
}

// ListenConfig parses OUTBOX_LISTEN_URL, the direct connection the relays
// LISTEN on (nil when listenURL is empty: they LISTEN on a connection made
// from DATABASE_URL). It is one plain session, so pgx's defaults apply.
func ListenConfig(listenURL string) (*pgx.ConnConfig, error) {
	if listenURL == "" {
		return nil, nil
	}
	cfg, err := pgx.ParseConfig(listenURL)
	if err != nil {
		return nil, fmt.Errorf("parse OUTBOX_LISTEN_URL: %w", err)
	}
	return cfg, nil
}
