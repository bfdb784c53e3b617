package postgres_test

import (
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-inbox/reference/services/orders/internal/config"
	"github.com/outbox-inbox/reference/services/orders/internal/postgres"
)

// Behind a transaction pooler the pool never uses named prepared statements,
// keeps a query mode the URL chose when it works there, and refuses settings
// the pooler cannot carry.
func TestPoolConfigBehindATransactionPooler(t *testing.T) {
	const base = "postgres://postgres@127.0.0.1:6432/orders?sslmode=disable"
	for _, c := range []struct {
		url, pooler string
		want        pgx.QueryExecMode
		err         string
	}{
		{base, config.PoolerNone, pgx.QueryExecModeCacheStatement, ""},
		{base, config.PoolerTransaction, pgx.QueryExecModeCacheDescribe, ""},
		{base + "&default_query_exec_mode=cache_statement", config.PoolerTransaction, pgx.QueryExecModeCacheDescribe, ""},
		{base + "&default_query_exec_mode=exec", config.PoolerTransaction, pgx.QueryExecModeExec, ""},
		{base + "&default_query_exec_mode=simple_protocol", config.PoolerTransaction, pgx.QueryExecModeSimpleProtocol, ""},
		{base + "&default_query_exec_mode=describe_exec", config.PoolerTransaction, 0, "describe exec"},
		{base + "&search_path=orders", config.PoolerTransaction, 0, "search_path"},
		{base + "&options=-csearch_path%3Dorders", config.PoolerTransaction, 0, "options"},
		{base + "&search_path=orders", config.PoolerNone, pgx.QueryExecModeCacheStatement, ""},
		{base, "session", 0, "DATABASE_POOLER"},
	} {
		cfg, err := postgres.PoolConfig(c.url, c.pooler)
		switch {
		case c.err != "":
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Errorf("%s with %q: error %v, want one naming %s", c.url, c.pooler, err, c.err)
			}
		case err != nil:
			t.Errorf("%s with %q: %v", c.url, c.pooler, err)
		case cfg.ConnConfig.DefaultQueryExecMode != c.want:
			t.Errorf("%s with %q: mode %v, want %v", c.url, c.pooler, cfg.ConnConfig.DefaultQueryExecMode, c.want)
		case c.pooler == config.PoolerTransaction && cfg.ConnConfig.StatementCacheCapacity != 0:
			t.Errorf("%s with %q: statement cache of %d", c.url, c.pooler, cfg.ConnConfig.StatementCacheCapacity)
		}
	}
}
