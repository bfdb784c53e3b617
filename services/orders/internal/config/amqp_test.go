package config_test

import (
	"strings"
	"testing"

	"github.com/outbox-inbox/reference/services/orders/internal/config"
)

func TestAMQPURLMayListClusterNodes(t *testing.T) {
	nodes := "amqp://guest:guest@node1:5672/,amqp://guest:guest@node2:5672/, amqp://guest:guest@node3:5672/"
	cfg, err := config.FromEnv(func(k string) string { return map[string]string{"AMQP_URL": nodes}[k] })
	if err != nil {
		t.Fatal(err)
	}
	if cfg.AMQPURL != nodes {
		t.Errorf("AMQPURL = %q, want the list as given (the publisher splits it)", cfg.AMQPURL)
	}
	for _, bad := range []string{"amqp://node1/,", "http://node1/", "amqp://node1/,,amqp://node2/"} {
		_, err := config.FromEnv(func(k string) string { return map[string]string{"AMQP_URL": bad}[k] })
		if err == nil || !strings.Contains(err.Error(), "AMQP_URL") {
			t.Errorf("AMQP_URL=%q: err = %v, want an error naming AMQP_URL", bad, err)
		}
	}
}
