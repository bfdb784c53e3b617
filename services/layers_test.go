// Package services holds the test of the two services' layering; the
// services themselves are services/orders and services/shipping.
package services

import (
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// module is this repository's module path.
const module = "github.com/outbox-inbox/reference/"

// layer says what a package of a service is and which packages of the same
// service it may import. Any package may import the libraries (pkg/...), the
// repository's shared helpers (internal/...) and third-party modules, except
// a domain package, which imports the standard library only.
type layer struct {
	domain bool     // the service's domain types: the standard library only
	wiring bool     // main and the application's assembly: anything
	may    []string // the packages of its service it may import, from services/
}

// layers classifies every package of services/orders and services/shipping.
// The rule they follow (wtf's): the domain (order, shipment) sits at the
// centre and names no adapter; adapters (postgres, mongodb, rabbitmq,
// httpapi, metrics) depend on the domain, never on one another's storage;
// the consumer-side interfaces (httpapi.Orders, processor.Store) speak in
// domain types; only the wiring (main, shipping's app) imports a storage
// adapter to plug it in. A new package, or a new import between packages of
// a service, is a change of this table.
var layers = map[string]layer{
	"orders":                            {wiring: true},
	"orders/internal/order":             {domain: true},
	"orders/internal/config":            {},
	"orders/internal/httpapi":           {may: []string{"orders/internal/order"}},
	"orders/internal/metrics":           {},
	"orders/internal/postgres":          {may: []string{"orders/internal/order", "orders/internal/config", "orders/internal/postgres/ordersdb"}},
	"orders/internal/postgres/ordersdb": {may: []string{"orders/internal/order"}},
	// Test support: a Store on a schema of its own.
	"orders/internal/postgres/pgtest": {may: []string{"orders/internal/postgres"}},

	"shipping":                     {wiring: true},
	"shipping/internal/app":        {wiring: true},
	"shipping/internal/shipment":   {domain: true},
	"shipping/internal/amqpaddr":   {},
	"shipping/internal/amqptest":   {},
	"shipping/internal/metrics":    {},
	"shipping/internal/mongodb":    {may: []string{"shipping/internal/shipment"}},
	"shipping/internal/rabbitmq":   {may: []string{"shipping/internal/shipment", "shipping/internal/amqpaddr", "shipping/internal/metrics"}},
	"shipping/internal/deadletter": {may: []string{"shipping/internal/shipment"}},
	"shipping/internal/httpapi":    {may: []string{"shipping/internal/shipment"}},
	"shipping/internal/processor":  {may: []string{"shipping/internal/shipment", "shipping/internal/metrics"}},
	// The accounting of an end-to-end run reads what the stores kept: an
	// assembly of its own over them.
	"shipping/accounting": {may: []string{"shipping/internal/shipment", "shipping/internal/mongodb", "shipping/internal/deadletter"}},
}

func TestServicesKeepTheirLayers(t *testing.T) {
	imports, err := serviceImports(".")
	if err != nil {
		t.Fatal(err)
	}
	for pkg := range imports {
		if _, ok := layers[pkg]; !ok {
			t.Errorf("services/%s is in no layer: classify it in layers", pkg)
		}
	}
	for pkg, l := range layers {
		imps, ok := imports[pkg]
		if !ok {
			t.Errorf("layers names services/%s, which has no Go files", pkg)
			continue
		}
		for _, imp := range imps {
			if why := l.refuses(imp); why != "" {
				t.Errorf("services/%s imports %s: %s", pkg, imp, why)
			}
		}
	}
}

// refuses says why the layer may not import imp, or "".
func (l layer) refuses(imp string) string {
	own, inModule := strings.CutPrefix(imp, module)
	switch {
	case l.wiring:
		return ""
	case l.domain && (inModule || strings.Contains(strings.Split(imp, "/")[0], ".")):
		return "the domain imports the standard library only"
	case !inModule:
		return ""
	case strings.HasPrefix(own, "pkg/") || strings.HasPrefix(own, "internal/"):
		return ""
	}
	svc, ok := strings.CutPrefix(own, "services/")
	if ok && slices.Contains(l.may, svc) {
		return ""
	}
	return "not among the packages this layer may import (a domain type belongs in the domain package; an adapter is plugged in by the wiring)"
}

// serviceImports maps each package under dir (by its path from dir) to the
// imports of its non-test files.
func serviceImports(dir string) (map[string][]string, error) {
	out := map[string][]string{}
	fset := token.NewFileSet()
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return err
		}
		f, err := parser.ParseFile(fset, path, nil, parser.ImportsOnly)
		if err != nil {
			return err
		}
		pkg := filepath.ToSlash(filepath.Dir(path))
		for _, spec := range f.Imports {
			imp, err := strconv.Unquote(spec.Path.Value)
			if err != nil {
				return err
			}
			if !slices.Contains(out[pkg], imp) {
				out[pkg] = append(out[pkg], imp)
			}
		}
		if _, ok := out[pkg]; !ok {
			out[pkg] = nil
		}
		return nil
	})
	return out, err
}

// The test sees a planted violation: a domain package importing an adapter,
// an interface package importing a storage adapter.
func TestLayersRefuseWhatTheRuleForbids(t *testing.T) {
	for _, c := range []struct {
		pkg, imp string
	}{
		{"orders/internal/order", module + "services/orders/internal/postgres"},
		{"orders/internal/order", "github.com/jackc/pgx/v5"},
		{"orders/internal/httpapi", module + "services/orders/internal/postgres"},
		{"shipping/internal/processor", module + "services/shipping/internal/mongodb"},
		{"shipping/internal/processor", module + "services/shipping/internal/rabbitmq"},
		{"shipping/internal/processor", module + "services/shipping/internal/deadletter"},
		{"shipping/internal/httpapi", module + "services/shipping/internal/deadletter"},
		{"shipping/internal/deadletter", module + "services/shipping/internal/rabbitmq"},
		{"shipping/internal/rabbitmq", module + "services/shipping/internal/deadletter"},
		{"shipping/internal/shipment", module + "pkg/inbox"},
		{"shipping/internal/mongodb", module + "services/shipping/internal/app"},
	} {
		if layers[c.pkg].refuses(c.imp) == "" {
			t.Errorf("services/%s may import %s, want refused", c.pkg, c.imp)
		}
	}
	if why := layers["shipping/internal/app"].refuses(module + "services/shipping/internal/mongodb"); why != "" {
		t.Errorf("the wiring may not import the store: %s", why)
	}
}
