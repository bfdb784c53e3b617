package config_test

import (
	"testing"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/services/orders/internal/config"
)

func TestNotifyDefaultsToWhetherARelayRunsInProcess(t *testing.T) {
	cases := []struct {
		env                map[string]string
		wantNotify, listen bool
	}{
		{map[string]string{}, false, true},
		{map[string]string{"RELAY": "false"}, true, true},
		{map[string]string{"OUTBOX_NOTIFY": "true"}, true, true},
		{map[string]string{"OUTBOX_NOTIFY": "false", "RELAY": "false"}, false, false},
		{map[string]string{"OUTBOX_NOTIFY": " "}, false, true},
	}
	for _, c := range cases {
		cfg, err := config.FromEnv(func(k string) string { return c.env[k] })
		if err != nil {
			t.Fatalf("%v: %v", c.env, err)
		}
		if cfg.Notify != c.wantNotify || cfg.Listen != c.listen {
			t.Errorf("%v: Notify=%v Listen=%v, want %v %v", c.env, cfg.Notify, cfg.Listen, c.wantNotify, c.listen)
		}
	}
	if _, err := config.FromEnv(func(k string) string {
		return map[string]string{"OUTBOX_NOTIFY": "sometimes"}[k]
	}); err == nil {
		t.Error("OUTBOX_NOTIFY=sometimes accepted")
	}
}

func TestMigrateIsOffByDefault(t *testing.T) {
	for env, want := range map[string]bool{"": false, "true": true, "false": false, "1": true} {
		cfg, err := config.FromEnv(func(k string) string { return map[string]string{"MIGRATE": env}[k] })
		if err != nil || cfg.Migrate != want {
			t.Errorf("MIGRATE=%q: Migrate=%v (%v), want %v", env, cfg.Migrate, err, want)
		}
	}
	if _, err := config.FromEnv(func(k string) string { return map[string]string{"MIGRATE": "yes please"}[k] }); err == nil {
		t.Error(`MIGRATE="yes please" accepted`)
	}
}

func TestDatabasePoolerAndListenURL(t *testing.T) {
	for env, want := range map[string]string{"": config.PoolerNone, "none": config.PoolerNone, "Transaction": config.PoolerTransaction} {
		cfg, err := config.FromEnv(func(k string) string { return map[string]string{"DATABASE_POOLER": env}[k] })
		if err != nil || cfg.DatabasePooler != want {
			t.Errorf("DATABASE_POOLER=%q: %q (%v), want %q", env, cfg.DatabasePooler, err, want)
		}
	}
	if _, err := config.FromEnv(func(k string) string { return map[string]string{"DATABASE_POOLER": "pgbouncer"}[k] }); err == nil {
		t.Error("DATABASE_POOLER=pgbouncer accepted")
	}
	cfg, err := config.FromEnv(func(k string) string {
		return map[string]string{"OUTBOX_LISTEN_URL": " postgres://db:5432/orders "}[k]
	})
	if err != nil || cfg.ListenURL != "postgres://db:5432/orders" {
		t.Errorf("OUTBOX_LISTEN_URL: %q (%v)", cfg.ListenURL, err)
	}
}

func TestRelayMaxInFlightBytes(t *testing.T) {
	for env, want := range map[string]int64{"": outbox.DefaultMaxInFlightBytes, "1048576": 1 << 20} {
		cfg, err := config.FromEnv(func(k string) string { return map[string]string{"RELAY_MAX_IN_FLIGHT_BYTES": env}[k] })
		if err != nil || cfg.MaxInFlightBytes != want {
			t.Errorf("RELAY_MAX_IN_FLIGHT_BYTES=%q: %d (%v), want %d", env, cfg.MaxInFlightBytes, err, want)
		}
	}
	for _, bad := range []string{"0", "-1", "64MiB"} {
		if _, err := config.FromEnv(func(k string) string { return map[string]string{"RELAY_MAX_IN_FLIGHT_BYTES": bad}[k] }); err == nil {
			t.Errorf("RELAY_MAX_IN_FLIGHT_BYTES=%q accepted", bad)
		}
	}
}
