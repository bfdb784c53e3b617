package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/internal/crashpoint"
)

// action is one button of the live view. The faults are the demo's own: no
// service has an endpoint for them.
type action struct {
	Name  string // the URL's: POST /api/actions/{Name}
	Group string // the page's section
	Label string
	What  string // what the button does
	Watch string // what to watch for on the page
	// Confirm, when set, is asked in the browser before the action runs.
	Confirm string
	// crash marks an action that arms a crash point: only the local
	// supervisor can (the page leaves it out otherwise).
	crash bool
	// composeWhat, when set, replaces What under docker compose.
	composeWhat string
	run         func(ctx context.Context, v *liveView, r *http.Request) (actionResult, error)
}

type actionResult struct {
	Message string `json:"message"`
	OrderID string `json:"order_id,omitempty"`
}

const burstSize = 50

// actions, in the page's order. The stop and start buttons of each process
// are on its card (actions "stop" and "start", ?process=).
var actions = []action{
	{
		Name: "place-order", Group: "Orders", Label: "Place one order",
		What:  "POST /orders to the orders API: the order and its order.created event commit in one PostgreSQL transaction. The journey panel follows it.",
		Watch: "orders created +1; the event is pending for a moment, then published, delivered and applied once.",
		run: func(ctx context.Context, v *liveView, _ *http.Request) (actionResult, error) {
			return v.placeOrder(ctx, "one order")
		},
	},
	{
		Name: "place-burst", Group: "Orders", Label: fmt.Sprintf("Place %d orders", burstSize),
		What:  fmt.Sprintf("%d orders at once, 8 at a time.", burstSize),
		Watch: "pending climbs and drains; applied catches up with events written. With the relays stopped or the broker away, pending stays up and the oldest pending age grows: nothing is lost, it waits.",
		run:   placeBurst,
	},
	{
		Name: "cancel-order", Group: "Orders", Label: "Cancel the followed order",
		What:  "POST /orders/{id}/cancel for the order in the journey panel: a second event, order.cancelled, version 2.",
		Watch: "a second row in the journey. Shipping applies version 2 only after version 1, whatever order they arrive in.",
		run:   cancelOrder,
	},
	{
		Name: "stop-relays", Group: "Relays", Label: "Stop both relays",
		What:        "SIGTERM to relay-1 and relay-2; the demo keeps them down. The orders API does not need them.",
		composeWhat: "docker compose stop relay: every replica of the relay service (the orders API runs without a relay of its own here, ORDERS_RELAY=false). The orders API does not need them.",
		Watch:       "new orders still succeed, their events stay pending in the outbox; the oldest pending age grows.",
		run: func(ctx context.Context, v *liveView, _ *http.Request) (actionResult, error) {
			return v.holdAll(ctx, v.ctl.relays()...)
		},
	},
	{
		Name: "start-relays", Group: "Relays", Label: "Start both relays",
		What:        "Starts relay-1 and relay-2 again.",
		composeWhat: "docker compose start relay.",
		Watch:       "pending returns to 0; published and applied catch up with events written: every order became exactly one shipment.",
		run: func(ctx context.Context, v *liveView, _ *http.Request) (actionResult, error) {
			return v.resumeAll(ctx, v.ctl.relays()...)
		},
	},
	{
		Name: "crash-relay", Group: "Crashes", Label: "Kill relay-1 between publish and mark", crash: true,
		What: "Stops relay-2 (so relay-1 takes the next order), restarts relay-1 armed with the crash point " + crashpoint.RelayAfterPublishBeforeMark +
			", and places one order: relay-1 publishes it, RabbitMQ confirms, and relay-1 kills itself before it marks the row published. The demo restarts it.",
		Watch: "the order is applied once, but its outbox row stays pending (in flight). When the dead relay's lease runs out (RELAY_LEASE, 30 s), it is published again: the journey shows delivered 2×, and duplicates absorbed +1 (inbox). Start relay-2 again when you like.",
		run:   crashRelay,
	},
	{
		Name: "crash-shipping", Group: "Crashes", Label: "Kill shipping between the effect and the ack", crash: true,
		What: "Restarts shipping armed with the crash point " + crashpoint.ShippingAfterInboxBeforeAck +
			", and places one order: shipping applies it and kills itself before it acks the delivery. The demo restarts it.",
		Watch: "shipping restarting; RabbitMQ delivers the message again and shipping recognises the duplicate (inbox or version): the journey shows delivered 2×, applied once.",
		run:   crashShipping,
	},
	{
		Name: "broker-cut", Group: "Broker", Label: "Cut the broker connections",
		What:  "rabbitmqctl close_all_connections on the demo's vhost: every connection of the relays, shipping and this page is dropped.",
		Watch: "the relays and shipping reconnect by themselves within seconds; nothing pending stays pending.",
		run:   brokerCut,
	},
	{
		Name: "broker-down", Group: "Broker", Label: "Take the broker away",
		What:  "rabbitmqctl clear_permissions, then close_all_connections, on the demo's vhost: the broker drops the services and refuses them until it is back. Other vhosts are not touched.",
		Watch: "relays and shipping not ready; orders still succeed and pile up as pending; the oldest pending age grows.",
		run:   brokerDown,
	},
	{
		Name: "broker-up", Group: "Broker", Label: "Bring the broker back",
		What:  "rabbitmqctl set_permissions on the demo's vhost.",
		Watch: "the relays reconnect and drain the outbox; pending returns to 0; applied catches up.",
		run:   brokerUp,
	},
	{
		Name: "broker-stop-app", Group: "Broker", Label: "Stop the broker application",
		What:        "rabbitmqctl stop_app: the whole broker stops, for every vhost and every user of this RabbitMQ.",
		composeWhat: "docker compose exec rabbitmq rabbitmqctl stop_app: the compose project's broker stops (the container keeps running).",
		Watch:       "as for taking the broker away. Only on a broker that is yours alone.",
		Confirm:     "rabbitmqctl stop_app stops RabbitMQ for everyone who uses it on this machine, not only this demo. Go on?",
		run: func(ctx context.Context, v *liveView, _ *http.Request) (actionResult, error) {
			return v.rabbitmqctl(ctx, "stop_app")
		},
	},
	{
		Name: "broker-start-app", Group: "Broker", Label: "Start the broker application",
		What:  "rabbitmqctl start_app.",
		Watch: "queues come back with their messages; everything reconnects and drains.",
		run: func(ctx context.Context, v *liveView, _ *http.Request) (actionResult, error) {
			return v.rabbitmqctl(ctx, "start_app")
		},
	},
	{
		Name: "stop", Label: "Stop", run: func(ctx context.Context, v *liveView, r *http.Request) (actionResult, error) {
			return v.holdAll(ctx, r.URL.Query().Get("process"))
		},
	},
	{
		Name: "start", Label: "Start", run: func(ctx context.Context, v *liveView, r *http.Request) (actionResult, error) {
			return v.resumeAll(ctx, r.URL.Query().Get("process"))
		},
	},
}

// errBadRequest marks an action's error as the caller's.
var errBadRequest = errors.New("bad request")

func (v *liveView) serveAction(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("name")
	for _, a := range actions {
		if a.Name != name {
			continue
		}
		if a.crash && !v.canArm() {
			writeError(w, http.StatusNotImplemented, "not_available",
				fmt.Sprintf("%s: not available with %s: a crash point is armed in a process's environment when the demo starts it (DEMO_MODE=local make demo)", a.Label, v.ctl.mode()))
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), time.Minute)
		defer cancel()
		res, err := a.run(ctx, v, r)
		if err != nil {
			status := http.StatusBadGateway
			switch {
			case errors.Is(err, errBadRequest):
				status = http.StatusBadRequest
			case errors.Is(err, errUnsupported):
				status = http.StatusNotImplemented
			}
			v.addNote("%s: failed: %v", labelOf(a, r), err)
			writeError(w, status, "action_failed", err.Error())
			return
		}
		v.addNote("%s: %s", labelOf(a, r), res.Message)
		writeJSON(w, http.StatusOK, res)
		return
	}
	writeError(w, http.StatusNotFound, "unknown_action", "no action "+name)
}

func labelOf(a action, r *http.Request) string {
	if p := r.URL.Query().Get("process"); p != "" {
		return a.Label + " " + p
	}
	return a.Label
}

// holdAll stops the named processes and keeps them down.
func (v *liveView) holdAll(ctx context.Context, names ...string) (actionResult, error) {
	if err := v.ctl.stop(ctx, names...); err != nil {
		return actionResult{}, err
	}
	return actionResult{Message: strings.Join(names, " and ") + " stopped"}, nil
}

// resumeAll starts held processes again; one already running is left alone.
func (v *liveView) resumeAll(ctx context.Context, names ...string) (actionResult, error) {
	started, err := v.ctl.start(ctx, names...)
	if err != nil {
		return actionResult{}, err
	}
	if len(started) == 0 {
		return actionResult{Message: strings.Join(names, " and ") + ": already running"}, nil
	}
	return actionResult{Message: "starting " + strings.Join(started, " and ")}, nil
}

// rearm restarts a process with a crash point armed for its next run only.
func (v *liveView) rearm(ctx context.Context, name, point, what string) error {
	return v.ctl.arm(ctx, name, point, what)
}

func crashRelay(ctx context.Context, v *liveView, _ *http.Request) (actionResult, error) {
	if _, err := v.holdAll(ctx, "relay-2"); err != nil {
		return actionResult{}, err
	}
	if err := v.rearm(ctx, "relay-1", crashpoint.RelayAfterPublishBeforeMark, "dies after its next publish is confirmed, before the mark"); err != nil {
		return actionResult{}, err
	}
	res, err := v.placeOrder(ctx, "an order for relay-1 to publish")
	if err != nil {
		return res, err
	}
	res.Message = "relay-2 stopped, relay-1 armed; " + res.Message
	return res, nil
}

func crashShipping(ctx context.Context, v *liveView, _ *http.Request) (actionResult, error) {
	if err := v.rearm(ctx, "shipping", crashpoint.ShippingAfterInboxBeforeAck, "dies after its next effect, before the ack"); err != nil {
		return actionResult{}, err
	}
	res, err := v.placeOrder(ctx, "an order for shipping to apply")
	if err != nil {
		return res, err
	}
	res.Message = "shipping armed; " + res.Message
	return res, nil
}

var orderSeq atomic.Int64

// placeOrder creates one order through the orders API.
func (v *liveView) placeOrder(ctx context.Context, what string) (actionResult, error) {
	body, _ := json.Marshal(map[string]any{
		"customer_id": fmt.Sprintf("c-%d", 1+rand.IntN(99)),
		"currency":    "EUR",
		"items":       []map[string]any{{"sku": fmt.Sprintf("sku-%d", 1+rand.IntN(9)), "quantity": 1 + rand.IntN(3), "unit_price": 1250}},
	})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+v.d.cfg.OrdersAddr+"/orders", bytes.NewReader(body))
	if err != nil {
		return actionResult{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", fmt.Sprintf("live-view-%s-%d", uuid.NewString(), orderSeq.Add(1)))
	resp, err := v.client.Do(req)
	if err != nil {
		return actionResult{}, fmt.Errorf("orders API: %w", err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode != http.StatusCreated {
		return actionResult{}, fmt.Errorf("orders API: %s: %s", resp.Status, bytes.TrimSpace(raw))
	}
	var o struct {
		ID string `json:"id"`
	}
	if err := json.Unmarshal(raw, &o); err != nil || o.ID == "" {
		return actionResult{}, fmt.Errorf("orders API: unexpected answer %q", raw)
	}
	return actionResult{Message: fmt.Sprintf("placed %s: order %s", what, o.ID), OrderID: o.ID}, nil
}

func placeBurst(ctx context.Context, v *liveView, _ *http.Request) (actionResult, error) {
	var wg sync.WaitGroup
	var placed atomic.Int64
	errs := make(chan error, burstSize)
	work := make(chan struct{}, burstSize)
	for range burstSize {
		work <- struct{}{}
	}
	close(work)
	for range 8 {
		wg.Go(func() {
			for range work {
				if _, err := v.placeOrder(ctx, "order"); err != nil {
					errs <- err
					continue
				}
				placed.Add(1)
			}
		})
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return actionResult{}, fmt.Errorf("%d of %d orders placed; first failure: %w", placed.Load(), burstSize, err)
	}
	return actionResult{Message: fmt.Sprintf("placed %d orders", placed.Load())}, nil
}

func cancelOrder(ctx context.Context, v *liveView, r *http.Request) (actionResult, error) {
	id := r.URL.Query().Get("order")
	if _, err := uuid.Parse(id); err != nil || len(id) != 36 {
		return actionResult{}, fmt.Errorf("%w: no order followed: place one first", errBadRequest)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+v.d.cfg.OrdersAddr+"/orders/"+id+"/cancel", nil)
	if err != nil {
		return actionResult{}, err
	}
	resp, err := v.client.Do(req)
	if err != nil {
		return actionResult{}, fmt.Errorf("orders API: %w", err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode != http.StatusOK {
		return actionResult{}, fmt.Errorf("orders API: %s: %s", resp.Status, bytes.TrimSpace(raw))
	}
	return actionResult{Message: "cancelled order " + id, OrderID: id}, nil
}

// vhostAndUser are the demo's RabbitMQ vhost and user, from AMQP_URL.
func (v *liveView) vhostAndUser() (string, string, error) {
	u, err := amqp.ParseURI(v.d.cfg.AMQPURL)
	if err != nil {
		return "", "", fmt.Errorf("AMQP_URL: %w", err)
	}
	return u.Vhost, u.Username, nil
}

func brokerCut(ctx context.Context, v *liveView, _ *http.Request) (actionResult, error) {
	vhost, _, err := v.vhostAndUser()
	if err != nil {
		return actionResult{}, err
	}
	return v.rabbitmqctl(ctx, "close_all_connections", "-p", vhost, "demo: connections cut")
}

func brokerDown(ctx context.Context, v *liveView, _ *http.Request) (actionResult, error) {
	vhost, user, err := v.vhostAndUser()
	if err != nil {
		return actionResult{}, err
	}
	if _, err := v.rabbitmqctl(ctx, "clear_permissions", "-p", vhost, user); err != nil {
		return actionResult{}, err
	}
	res, err := v.rabbitmqctl(ctx, "close_all_connections", "-p", vhost, "demo: broker outage")
	if err != nil {
		return res, err
	}
	res.Message = fmt.Sprintf("%s refused on vhost %s; %s", user, vhost, res.Message)
	return res, nil
}

func brokerUp(ctx context.Context, v *liveView, _ *http.Request) (actionResult, error) {
	vhost, user, err := v.vhostAndUser()
	if err != nil {
		return actionResult{}, err
	}
	if _, err := v.rabbitmqctl(ctx, "set_permissions", "-p", vhost, user, ".*", ".*", ".*"); err != nil {
		return actionResult{}, err
	}
	return actionResult{Message: fmt.Sprintf("%s allowed on vhost %s again", user, vhost)}, nil
}

// rabbitmqctl runs rabbitmqctl on the broker, through the controller.
func (v *liveView) rabbitmqctl(ctx context.Context, args ...string) (actionResult, error) {
	text, err := v.ctl.rabbitmqctl(ctx, args...)
	if err != nil {
		return actionResult{}, err
	}
	if text == "" {
		text = "done"
	}
	return actionResult{Message: "rabbitmqctl " + args[0] + ": " + text}, nil
}
