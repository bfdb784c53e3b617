package outboxwal_test

import (
	"testing"

	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
)

// newProxy is a TCP forwarder in front of the test broker, to cut it (see
// outboxtest.Proxy).
func newProxy(t testing.TB) *outboxtest.Proxy { return outboxtest.NewProxy(t, testAMQPURL()) }
