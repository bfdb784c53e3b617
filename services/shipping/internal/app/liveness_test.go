package app_test

import (
	"net/http"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/services/shipping/internal/amqptest"
	"github.com/outbox-inbox/reference/services/shipping/internal/app"
)

// Deleting the queue under the running service cancels its consumer: /readyz
// must turn 503, and the service must redeclare the queue, turn ready again
// and apply new events.
func TestReadyzFollowsAQueueDeletedUnderTheConsumer(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	a := e.start(app.Config{})
	readyz := "http://" + a.HTTPAddr() + "/readyz"
	status := func() int {
		code, _, _ := get(t, readyz)
		return code
	}

	e.pub.publish(created("1101", "order-11"))
	e.waitShipment("order-11", 1)
	if code := status(); code != http.StatusOK {
		t.Fatalf("/readyz %d before the queue is deleted, want 200", code)
	}

	// Revoked access keeps the service from reconnecting, so the 503 can be
	// observed without racing the redeclaration.
	amqptest.RevokeAccess(t, e.vhost)
	amqptest.DeleteQueue(t, e.vhost, a.Topology().Queue)
	waitFor(t, 30*time.Second, "/readyz 503 after the queue is deleted", func() bool {
		return status() == http.StatusServiceUnavailable
	})
	amqptest.RestoreAccess(t, e.vhost)
	waitFor(t, 30*time.Second, "/readyz 200 after the redeclaration", func() bool {
		return status() == http.StatusOK
	})

	e.pub.publish(cancelled("1102", "order-11"))
	s := e.waitShipment("order-11", 2)
	wantEvents(t, s, "1101", "1102")
}
