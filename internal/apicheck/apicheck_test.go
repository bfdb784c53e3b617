package apicheck

import (
	"bytes"
	"flag"
	"fmt"
	"go/ast"
	"go/doc"
	"go/parser"
	"go/printer"
	"go/token"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite testdata/*.api from the packages")

// packages are the public packages whose exported API is listed, by
// directory from the repository's root.
var packages = []string{
	"pkg/outbox",
	"pkg/outbox/outboxamqp",
	"pkg/outbox/outboxadmin",
	"pkg/outbox/outboxaudit",
	"pkg/outbox/outboxbackfill",
	"pkg/outbox/outboxnats",
	"pkg/outbox/outboxotel",
	"pkg/outbox/outboxwal",
	"pkg/outbox/publishertest",
	"pkg/inbox",
	"pkg/inbox/inboxcheck",
	"pkg/inbox/inboxotel",
}

func TestExportedAPIIsTheListedOne(t *testing.T) {
	for _, dir := range packages {
		t.Run(dir, func(t *testing.T) {
			got, err := exportedAPI(filepath.Join("..", "..", filepath.FromSlash(dir)))
			if err != nil {
				t.Fatal(err)
			}
			file := filepath.Join("testdata", strings.ReplaceAll(dir, "/", "_")+".api")
			if *update {
				if err := os.WriteFile(file, []byte(strings.Join(got, "\n")+"\n"), 0o644); err != nil {
					t.Fatal(err)
				}
				return
			}
			b, err := os.ReadFile(file)
			if err != nil {
				t.Fatalf("%v (run go test ./internal/apicheck -update)", err)
			}
			want := strings.Split(strings.TrimSuffix(string(b), "\n"), "\n")
			added, removed := difference(got, want), difference(want, got)
			if len(added)+len(removed) > 0 {
				var diff strings.Builder
				for _, l := range added {
					diff.WriteString("+ " + l + "\n")
				}
				for _, l := range removed {
					diff.WriteString("- " + l + "\n")
				}
				t.Errorf("the exported API of %s is not the one listed in %s:\n%s"+
					"a change of the public API is a decision: if it is meant, run go test ./internal/apicheck -update and commit the listing",
					dir, file, diff.String())
			}
		})
	}
}

// Planted in a copy of a listed package, an exported function the listing
// does not have is found, and so is a changed signature.
func TestExportedAPISeesAGrowthAndAChange(t *testing.T) {
	dir := t.TempDir()
	src := "package p\n\n// F is listed.\nfunc F(a int) error { return nil }\n\ntype T struct {\n\tA int\n\tb int\n}\n"
	if err := os.WriteFile(filepath.Join(dir, "p.go"), []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	before, err := exportedAPI(dir)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"func F(a int) error", "type T struct", "type T struct, A int"}
	if !slices.Equal(before, want) {
		t.Fatalf("listing %q, want %q", before, want)
	}
	grown := strings.Replace(src, "func F(a int)", "func F(a int, b string)", 1) + "\nfunc G() {}\n"
	if err := os.WriteFile(filepath.Join(dir, "p.go"), []byte(grown), 0o644); err != nil {
		t.Fatal(err)
	}
	after, err := exportedAPI(dir)
	if err != nil {
		t.Fatal(err)
	}
	if added := difference(after, before); !slices.Equal(added, []string{"func F(a int, b string) error", "func G()"}) {
		t.Fatalf("added %q, want the new signature of F and G", added)
	}
}

// difference returns the lines of a that b lacks.
func difference(a, b []string) []string {
	var out []string
	for _, l := range a {
		if !slices.Contains(b, l) {
			out = append(out, l)
		}
	}
	return out
}

// exportedAPI lists the exported declarations of the package in dir (its
// non-test files), one per line, sorted: functions and methods with their
// signatures, types with their exported fields and methods, constants and
// variables with their values. Comments are left out: only a change of
// what a caller can use changes the listing.
func exportedAPI(dir string) ([]string, error) {
	fset := token.NewFileSet()
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var files []*ast.File
	for _, e := range entries {
		name := e.Name()
		if e.IsDir() || !strings.HasSuffix(name, ".go") || strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, filepath.Join(dir, name), nil, parser.SkipObjectResolution)
		if err != nil {
			return nil, err
		}
		files = append(files, f)
	}
	if len(files) == 0 {
		return nil, fmt.Errorf("%s: no Go files", dir)
	}
	pkg, err := doc.NewFromFiles(fset, files, "example.com/"+filepath.Base(dir))
	if err != nil {
		return nil, err
	}
	l := &lister{fset: fset}
	l.values("const", pkg.Consts)
	l.values("var", pkg.Vars)
	l.funcs(pkg.Funcs)
	for _, typ := range pkg.Types {
		l.typ(typ)
		l.values("const", typ.Consts)
		l.values("var", typ.Vars)
		l.funcs(typ.Funcs)
		l.funcs(typ.Methods)
	}
	slices.Sort(l.lines)
	return slices.Compact(l.lines), nil
}

type lister struct {
	fset  *token.FileSet
	lines []string
}

// node prints n on one line.
func (l *lister) node(n any) string {
	var b bytes.Buffer
	if err := printer.Fprint(&b, l.fset, n); err != nil {
		return fmt.Sprintf("<%v>", err)
	}
	return strings.Join(strings.Fields(b.String()), " ")
}

func (l *lister) values(kind string, values []*doc.Value) {
	for _, v := range values {
		for _, spec := range v.Decl.Specs {
			vs := spec.(*ast.ValueSpec)
			for i, name := range vs.Names {
				if !name.IsExported() {
					continue
				}
				line := kind + " " + name.Name
				if vs.Type != nil {
					line += " " + l.node(vs.Type)
				}
				if i < len(vs.Values) {
					line += " = " + l.node(vs.Values[i])
				}
				l.lines = append(l.lines, line)
			}
		}
	}
}

func (l *lister) funcs(funcs []*doc.Func) {
	for _, f := range funcs {
		d := &ast.FuncDecl{Name: f.Decl.Name, Type: f.Decl.Type}
		if f.Decl.Recv != nil {
			recv := *f.Decl.Recv
			recv.List = []*ast.Field{{Type: f.Decl.Recv.List[0].Type}}
			d.Recv = &recv
		}
		l.lines = append(l.lines, l.node(d))
	}
}

func (l *lister) typ(t *doc.Type) {
	for _, spec := range t.Decl.Specs {
		ts := spec.(*ast.TypeSpec)
		if !ts.Name.IsExported() {
			continue
		}
		name := ts.Name.Name
		if ts.TypeParams != nil {
			name += l.node(ts.TypeParams)
		}
		switch typ := ts.Type.(type) {
		case *ast.StructType:
			l.lines = append(l.lines, "type "+name+" struct")
			for _, f := range typ.Fields.List {
				ft := l.node(f.Type)
				if len(f.Names) == 0 { // embedded
					if ast.IsExported(strings.TrimLeft(ft[strings.LastIndex(ft, ".")+1:], "*")) {
						l.lines = append(l.lines, "type "+name+" struct, embeds "+ft)
					}
					continue
				}
				for _, n := range f.Names {
					if n.IsExported() {
						l.lines = append(l.lines, "type "+name+" struct, "+n.Name+" "+ft)
					}
				}
			}
		case *ast.InterfaceType:
			l.lines = append(l.lines, "type "+name+" interface")
			for _, m := range typ.Methods.List {
				if len(m.Names) == 0 {
					l.lines = append(l.lines, "type "+name+" interface, embeds "+l.node(m.Type))
					continue
				}
				for _, n := range m.Names {
					l.lines = append(l.lines, "type "+name+" interface, "+n.Name+strings.TrimPrefix(l.node(m.Type), "func"))
				}
			}
		default:
			sep := " "
			if ts.Assign.IsValid() {
				sep = " = "
			}
			l.lines = append(l.lines, "type "+name+sep+l.node(ts.Type))
		}
	}
}
