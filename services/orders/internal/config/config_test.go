package config_test

import (
	"testing"

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
