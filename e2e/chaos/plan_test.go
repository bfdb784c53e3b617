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
				lo, hi := p.HoldMin, p.HoldMax
				if s.Kind.IsPause() {
					lo, hi = p.PauseMin, p.PauseMax
					if s.At+s.Hold > p.Load-p.Cooldown {
						t.Errorf("%s seed %d: %v: the pause outlasts the fault window (ends after %v)", p.Name, seed, s, p.Load-p.Cooldown)
					}
				}
				if s.Hold < lo || s.Hold > hi {
					t.Errorf("%s seed %d: %v hold outside [%v, %v]", p.Name, seed, s, lo, hi)
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
	p, err = ProfileFromEnv(env("CHAOS_PROFILE", "long", "CHAOS_DURATION", "2m", "CHAOS_FAULTS", "60"))
	if err != nil || p.Name != "long" || p.Load != 2*time.Minute || p.Faults != 60 {
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

// The short profile (make test) pauses a relay and a shipping consumer and
// runs the faults on the PostgreSQL path; the long one has every pause and
// path kind. A pause outlasts the relays' lease the harness sets
// (RELAY_LEASE=6s) and the WAL relay's takeover on the run's own PostgreSQL
// (wal_sender_timeout=5s, then TakeoverInterval 1s).
func TestProfilesPause(t *testing.T) {
	short, long := ShortProfile(), LongProfile()
	for _, k := range []FaultKind{FaultPauseRelay, FaultPauseShipping, FaultPostgresRelayCut, FaultPostgresProxyTimeout} {
		if !slices.Contains(short.Kinds, k) {
			t.Errorf("the short profile lacks %s", k)
		}
	}
	for _, k := range PauseAndPathFaultKinds {
		if !slices.Contains(long.Kinds, k) {
			t.Errorf("the long profile lacks %s", k)
		}
		if k.Instant() {
			t.Errorf("%s is instant: it is held", k)
		}
	}
	const lease, takeover = 6 * time.Second, 5*time.Second + time.Second
	for _, p := range []Profile{short, long, ClusterProfile()} {
		if p.PauseMin <= max(lease, takeover) {
			t.Errorf("%s: PauseMin %v does not outlast the lease %v and the takeover %v", p.Name, p.PauseMin, lease, takeover)
		}
	}
}

func TestValidateRejectsPausesThatDoNotFit(t *testing.T) {
	p := ShortProfile()
	p.PauseMin, p.PauseMax = 0, 0
	if err := p.Validate(); err == nil {
		t.Error("a profile with pause kinds and no pause length validated")
	}
	p = ShortProfile()
	p.PauseMax = p.Load
	if err := p.Validate(); err == nil {
		t.Error("a pause longer than the fault window validated")
	}
	p = ShortProfile().Without(PauseFaultKinds...)
	p.PauseMin, p.PauseMax = 0, 0
	if err := p.Validate(); err != nil {
		t.Errorf("a profile without pauses needs no pause length: %v", err)
	}
}

// One relay is cut from PostgreSQL through its own proxy, never the API's;
// the other path faults act on any of the proxies; without standalone
// relays the API's proxy carries its in-process relay.
func TestPostgresPathTargets(t *testing.T) {
	two := Topology{Relays: 2, Consumers: 1}
	if got, want := two.targets(FaultPostgresRelayCut), []string{"postgres@relay-1", "postgres@relay-2"}; !slices.Equal(got, want) {
		t.Errorf("relay cut targets %v, want %v", got, want)
	}
	if got, want := two.targets(FaultPostgresProxyTimeout), []string{TargetPostgres, "postgres@relay-1", "postgres@relay-2"}; !slices.Equal(got, want) {
		t.Errorf("timeout targets %v, want %v", got, want)
	}
	if got := (Topology{Consumers: 1}).targets(FaultPostgresRelayCut); !slices.Equal(got, []string{TargetPostgres}) {
		t.Errorf("relay cut without standalone relays targets %v", got)
	}
	if got := two.targets(FaultPauseRelay); !slices.Equal(got, []string{"relay-1", "relay-2"}) {
		t.Errorf("pause_relay targets %v", got)
	}
	if got := two.targets(FaultPausePostgres); !slices.Equal(got, []string{TargetPostgres}) {
		t.Errorf("pause_postgres targets %v", got)
	}
}

// What a pause or a PostgreSQL path fault measured (how long the process
// was stopped, what the others did meanwhile) is in the report's
// fault_measures, as an infrastructure fault's is; a kill's is not.
func TestFaultMeasuresGiveThePausesMeasures(t *testing.T) {
	t0 := time.Date(2026, 12, 4, 12, 0, 0, 0, time.UTC)
	h := History{Faults: []Fault{
		{Kind: FaultKillRelay, Target: "relay-1", Start: t0, End: t0},
		{Kind: FaultPauseRelay, Target: "relay-2", Start: t0, End: t0.Add(9 * time.Second),
			Measures: map[string]float64{"pause_s": 9, "taken_over": 3}},
		{Kind: FaultPostgresRelayCut, Target: "postgres@relay-1", Start: t0.Add(time.Second), End: t0.Add(3 * time.Second),
			Measures: map[string]float64{"published_meanwhile": 12}},
	}}
	got := faultMeasures(h)
	if len(got) != 2 || got[0].Kind != FaultPauseRelay || got[0].Measures["taken_over"] != 3 || got[0].Seconds != 9 ||
		got[1].Kind != FaultPostgresRelayCut || got[1].Measures["published_meanwhile"] != 12 {
		t.Errorf("fault measures %+v: want the pause's and the relay cut's, not the kill's", got)
	}
}
