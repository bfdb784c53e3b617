package chaos

import (
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

var topo = Topology{Relays: 2, Consumers: 2}

func TestNewPlanCoversEveryKindInTheWindow(t *testing.T) {
	for _, p := range []Profile{ShortProfile(), LongProfile()} {
		topo := topo
		if p.Name == "long" {
			topo.Nodes = 1 // its broker alarm needs a broker node of the run's own
		}
		for seed := range int64(20) {
			plan, err := NewPlan(seed, p, topo)
			if err != nil {
				t.Fatalf("%s seed %d: %v", p.Name, seed, err)
			}
			if len(plan) != p.Faults {
				t.Errorf("%s seed %d: %d steps, want %d", p.Name, seed, len(plan), p.Faults)
			}
			seen := make(map[FaultKind]bool)
			for i, s := range plan {
				seen[s.Kind] = true
				if s.At < p.Warmup || s.At+s.Hold > p.Load {
					t.Errorf("%s seed %d: %v outside the window [%v, %v]", p.Name, seed, s, p.Warmup, p.Load)
				}
				if i > 0 && s.At < plan[i-1].At {
					t.Errorf("%s seed %d: step %d not sorted by time", p.Name, seed, i)
				}
				if s.Hold < p.HoldMin || s.Hold > p.HoldMax {
					t.Errorf("%s seed %d: %v hold outside [%v, %v]", p.Name, seed, s, p.HoldMin, p.HoldMax)
				}
				if _, crash := s.Kind.CrashPoint(); crash != (s.CrashAfter > 0) {
					t.Errorf("%s seed %d: %v: CrashAfter set for a non-crash kind or missing", p.Name, seed, s)
				}
				if !slices.Contains(topo.targets(s.Kind), s.Target) {
					t.Errorf("%s seed %d: %v: target not among %v", p.Name, seed, s, topo.targets(s.Kind))
				}
			}
			for _, k := range p.Kinds {
				if !seen[k] {
					t.Errorf("%s seed %d: kind %s never scheduled", p.Name, seed, k)
				}
			}
		}
	}
}

func TestNewPlanIsReproducible(t *testing.T) {
	a, _ := NewPlan(7, ShortProfile(), topo)
	b, _ := NewPlan(7, ShortProfile(), topo)
	c, _ := NewPlan(8, ShortProfile(), topo)
	if !reflect.DeepEqual(a, b) {
		t.Error("same seed, different plans")
	}
	if reflect.DeepEqual(a, c) {
		t.Error("different seeds, same plan")
	}
}

func TestShortProfileSparesTheSharedBroker(t *testing.T) {
	if slices.Contains(ShortProfile().Kinds, FaultBrokerAppRestart) {
		t.Error("the short profile stops the broker app that other packages' tests use")
	}
	if !slices.Contains(LongProfile().Kinds, FaultBrokerAppRestart) {
		t.Error("the long profile lacks the broker app restart")
	}
}

// The broker alarm blocks every publisher of the broker it is set on: a
// plan never sets it on the machine's broker (a topology without a node of
// the run's own), and the short profile, which runs on that broker, has none.
func TestBrokerAlarmNeedsABrokerOfTheRunsOwn(t *testing.T) {
	if slices.Contains(ShortProfile().Kinds, FaultBrokerAlarm) {
		t.Error("the short profile sets an alarm on the shared broker")
	}
	if !slices.Contains(LongProfile().Kinds, FaultBrokerAlarm) {
		t.Error("the long profile lacks the broker alarm")
	}
	if _, err := NewPlan(1, LongProfile(), Topology{Relays: 2, Consumers: 2}); err == nil {
		t.Error("a plan with a broker alarm was made for the machine's broker")
	}
	plan, err := NewPlan(1, LongProfile(), Topology{Relays: 2, Consumers: 2, Nodes: 1})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range plan {
		if s.Kind == FaultBrokerAlarm && s.Target != "node-1" {
			t.Errorf("%v: want the run's node-1", s)
		}
	}
}

func TestRelayKindsTargetTheAPIWithoutStandaloneRelays(t *testing.T) {
	plan, err := NewPlan(1, ShortProfile(), Topology{Relays: 0, Consumers: 1})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range plan {
		if (s.Kind == FaultKillRelay || s.Kind == FaultCrashRelayAfterPublish) && s.Target != TargetOrders {
			t.Errorf("%v: want target %s", s, TargetOrders)
		}
	}
}

func TestProfileFromEnv(t *testing.T) {
	env := func(kv ...string) func(string) string {
		return func(k string) string {
			for i := 0; i+1 < len(kv); i += 2 {
				if kv[i] == k {
					return kv[i+1]
				}
			}
			return ""
		}
	}
	p, err := ProfileFromEnv(env())
	if err != nil || p.Name != "short" {
		t.Fatalf("default: %v, %v", p.Name, err)
	}
	p, err = ProfileFromEnv(env("CHAOS_PROFILE", "long", "CHAOS_DURATION", "2m", "CHAOS_FAULTS", "40"))
	if err != nil || p.Name != "long" || p.Load != 2*time.Minute || p.Faults != 40 {
		t.Fatalf("long with overrides: %+v, %v", p, err)
	}
	p, err = ProfileFromEnv(env("CHAOS_BROKER_RESTART", "true"))
	if err != nil || !slices.Contains(p.Kinds, FaultBrokerAppRestart) {
		t.Fatalf("short with broker restart: %v, %v", p.Kinds, err)
	}
	p, err = ProfileFromEnv(env("CHAOS_PROFILE", "long", "CHAOS_BROKER_RESTART", "false"))
	if err != nil || slices.Contains(p.Kinds, FaultBrokerAppRestart) {
		t.Fatalf("long without broker restart: %v, %v", p.Kinds, err)
	}
	for _, bad := range [][]string{
		{"CHAOS_PROFILE", "medium"},
		{"CHAOS_DURATION", "soon"},
		{"CHAOS_DURATION", "1s"},
		{"CHAOS_FAULTS", "3"},
		{"CHAOS_FAULTS", "many"},
		{"CHAOS_BROKER_RESTART", "maybe"},
	} {
		if _, err := ProfileFromEnv(env(bad...)); err == nil || !strings.Contains(err.Error(), bad[0]) && !strings.Contains(err.Error(), "profile") {
			t.Errorf("%v: err = %v, want an error naming it", bad, err)
		}
	}
}

func TestFaultKindHelpers(t *testing.T) {
	if p, ok := FaultCrashRelayAfterPublish.CrashPoint(); !ok || p != "relay.after_publish_before_mark" {
		t.Errorf("CrashPoint() = %q, %v", p, ok)
	}
	if k, ok := FaultPoisonOversize.PoisonKind(); !ok || k != PoisonOversize {
		t.Errorf("PoisonKind() = %q, %v", k, ok)
	}
	if FaultBrokerProxyDown.Instant() || !FaultKillRelay.Instant() || FaultCrashShippingAfterInbox.Instant() {
		t.Error("Instant() wrong")
	}
	if PoisonUnknownType.ExpectDeadLetter() || !PoisonMissingMessageID.ExpectDeadLetter() {
		t.Error("ExpectDeadLetter() wrong")
	}
}
