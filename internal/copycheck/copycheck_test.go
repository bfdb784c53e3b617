package copycheck

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"go/doc"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/internal/mongolocal"
)

// thisModule is the module path the packages have in this repository.
const thisModule = "github.com/outbox-inbox/reference"

// copyModule is the module path of the scratch module a package is copied
// into.
const copyModule = "example.com/copy"

// forbidden are modules no copy may inherit: the servers, containers and
// embedded databases the repository's own tests use.
var forbidden = []string{
	"github.com/FerretDB/",
	"github.com/testcontainers/",
	"github.com/docker/",
	"modernc.org/",
	"github.com/outbox-inbox/",
}

// TestPackagesCopyIntoAModuleOfTheirOwn copies each package directory, with
// its subpackages and tests, into a scratch module of its own (a go.mod with
// nothing but this repository's requirements as the versions to start
// from), rewrites the package's own import path, runs go mod tidy and go
// vet there (vet type-checks every test file, so a test that would not
// build in the copy fails here), runs the examples against the real
// servers, and lists the modules the copy adds to its go.mod. A copy that
// still imports anything of this repository fails to build; one whose
// go.mod inherits a forbidden module, or requires a module its doc.go does
// not name (each with what it is for), fails.
//
// The copies' other tests are not run again: the copy resolves the same
// module versions as this repository (tidy keeps the requirements it starts
// from), so they are the tests the repository's own run has just passed,
// with the race detector on.
func TestPackagesCopyIntoAModuleOfTheirOwn(t *testing.T) {
	if testing.Short() {
		t.Skip("copycheck: builds and tests two modules; not in -short")
	}
	root := filepath.Dir(goEnv(t, "GOMOD"))
	repoMod := readModFile(t, root)
	sum, err := os.ReadFile(filepath.Join(root, "go.sum"))
	if err != nil {
		t.Fatal(err)
	}
	mongoURI := server(t)
	for _, pkg := range []string{"pkg/inbox", "pkg/outbox"} {
		t.Run(pkg, func(t *testing.T) {
			dir := scratchDir(t, root, pkg)
			copyTree(t, filepath.Join(root, pkg), dir, thisModule+"/"+pkg, copyModule)
			if err := os.WriteFile(filepath.Join(dir, "go.mod"), scratchGoMod(t, repoMod), 0o644); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(dir, "go.sum"), sum, 0o644); err != nil {
				t.Fatal(err)
			}
			env := []string{"TEST_MONGO_URI=" + mongoURI}
			run(t, dir, nil, "mod", "tidy")
			run(t, dir, nil, "vet", "./...")
			out := output(t, dir, env, "test", "-count=1", "-v", "-run", "^Example", "./...")
			examples := strings.Count(out, "--- PASS: Example")
			if want := countExamples(t, filepath.Join(root, pkg)); examples != want {
				t.Errorf("%d examples passed in the copy, want the %d of %s", examples, want, pkg)
			}
			t.Logf("the copy's %d examples passed", examples)

			mod := readModFile(t, dir)
			// What lets the copies skip their other tests: every module
			// the copy requires is at the version this repository's tests
			// ran with.
			repoVersion := make(map[string]string, len(repoMod.Require))
			for _, r := range repoMod.Require {
				repoVersion[r.Path] = r.Version
			}
			var direct, indirect []string
			for _, r := range mod.Require {
				if v, ok := repoVersion[r.Path]; !ok || v != r.Version {
					t.Errorf("the copy requires %s@%s, this repository %q: its tests ran with other modules", r.Path, r.Version, v)
				}
				for _, f := range forbidden {
					if strings.HasPrefix(r.Path, f) {
						t.Errorf("the copy's go.mod requires %s@%s: a copier would inherit it", r.Path, r.Version)
					}
				}
				if r.Indirect {
					indirect = append(indirect, r.Path+"@"+r.Version)
				} else {
					direct = append(direct, r.Path+"@"+r.Version)
				}
			}
			t.Logf("a copy of %s adds to go.mod %d modules it imports: %s", pkg, len(direct), strings.Join(direct, ", "))
			t.Logf("and %d indirect ones: %s", len(indirect), strings.Join(indirect, ", "))
			doc, err := os.ReadFile(filepath.Join(root, pkg, "doc.go"))
			if err != nil {
				t.Fatal(err)
			}
			for _, r := range mod.Require {
				named := regexp.MustCompile(regexp.QuoteMeta(r.Path) + `[^A-Za-z0-9_./-]`)
				if !r.Indirect && !named.Match(doc) {
					t.Errorf("%s/doc.go does not say what %s is for, and a copy requires it", pkg, r.Path)
				}
			}

			// The packages may use the OpenTelemetry API (outbox/outboxotel,
			// inbox/inboxotel do) but never its SDK, which is the
			// application's choice: what a user's build pulls in are the
			// deps of the importable packages (their internal packages
			// included), the test helpers left out.
			listArgs := []string{"list", "-deps"}
			for p := range strings.FieldsSeq(output(t, dir, nil, "list", "./...")) {
				if !strings.Contains(p+"/", "/internal/") {
					listArgs = append(listArgs, p)
				}
			}
			for dep := range strings.FieldsSeq(output(t, dir, nil, listArgs...)) {
				if strings.HasPrefix(dep, "go.opentelemetry.io/otel/sdk") || strings.HasPrefix(dep, "go.opentelemetry.io/otel/exporters") {
					t.Errorf("%s imports %s (the OpenTelemetry SDK is for applications, not for these packages)", pkg, dep)
				}
			}
		})
	}
}

// scratchDir returns an empty directory for the copy of pkg. It is the same
// from one run to the next (under the user's cache directory, apart for
// each checkout), so that the build and vet caches still hold what an
// unchanged copy needs.
func scratchDir(t *testing.T, root, pkg string) string {
	t.Helper()
	base, err := os.UserCacheDir()
	if err != nil {
		return t.TempDir()
	}
	sum := sha256.Sum256([]byte(root))
	dir := filepath.Join(base, "outbox-inbox-copycheck", hex.EncodeToString(sum[:6]), filepath.Base(pkg))
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// copyTree copies src into dst, rewriting the import path from to to in Go
// files.
func copyTree(t *testing.T, src, dst, from, to string) {
	t.Helper()
	err := filepath.WalkDir(src, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(src, path)
		if err != nil {
			return err
		}
		target := filepath.Join(dst, rel)
		if d.IsDir() {
			return os.MkdirAll(target, 0o755)
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		if strings.HasSuffix(path, ".go") {
			b = bytes.ReplaceAll(b, []byte(`"`+from), []byte(`"`+to))
		}
		return os.WriteFile(target, b, 0o644)
	})
	if err != nil {
		t.Fatalf("copy %s: %v", src, err)
	}
}

// modFile is go.mod as go mod edit -json reads it.
type modFile struct {
	Go      string
	Require []struct {
		Path     string
		Version  string
		Indirect bool
	}
}

// readModFile reads dir's go.mod.
func readModFile(t *testing.T, dir string) modFile {
	t.Helper()
	var f modFile
	if err := json.Unmarshal([]byte(output(t, dir, nil, "mod", "edit", "-json")), &f); err != nil {
		t.Fatalf("go mod edit -json in %s: %v", dir, err)
	}
	return f
}

// scratchGoMod is a go.mod for the copy: its own module path, this
// repository's go version, and this repository's requirements as the
// versions to start from (the versions its tests ran with; go mod tidy
// keeps those the copy needs and drops the rest), so that the check does
// not depend on what the module proxy serves as latest today.
func scratchGoMod(t *testing.T, repo modFile) []byte {
	t.Helper()
	var b bytes.Buffer
	fmt.Fprintf(&b, "module %s\n\ngo %s\n\nrequire (\n", copyModule, repo.Go)
	for _, r := range repo.Require {
		fmt.Fprintf(&b, "\t%s %s // indirect\n", r.Path, r.Version)
	}
	b.WriteString(")\n")
	return b.Bytes()
}

// server starts the embedded FerretDB the copied inbox's examples use (they
// cannot start this repository's). It stops when the test ends.
func server(t *testing.T) string {
	t.Helper()
	srv, err := mongolocal.Start(t.Context(), mongolocal.Config{})
	if err != nil {
		t.Fatalf("start an embedded FerretDB: %v", err)
	}
	t.Cleanup(func() {
		if err := srv.Close(); err != nil {
			t.Errorf("stop the embedded FerretDB: %v", err)
		}
	})
	return srv.URI()
}

// countExamples counts the runnable examples under dir: the Example
// functions of its test files with an output comment.
func countExamples(t *testing.T, dir string) int {
	t.Helper()
	n := 0
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, "_test.go") {
			return err
		}
		fset := token.NewFileSet()
		f, err := parser.ParseFile(fset, path, nil, parser.ParseComments)
		if err != nil {
			return err
		}
		for _, ex := range doc.Examples(f) {
			if ex.Output != "" || ex.EmptyOutput {
				n++
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func goEnv(t *testing.T, key string) string {
	t.Helper()
	out, err := exec.Command("go", "env", key).Output()
	if err != nil {
		t.Fatalf("go env %s: %v", key, err)
	}
	v := strings.TrimSpace(string(out))
	if v == "" || v == os.DevNull {
		t.Fatalf("go env %s: %q, want this repository's go.mod", key, v)
	}
	return v
}

func run(t *testing.T, dir string, env []string, args ...string) {
	t.Helper()
	output(t, dir, env, args...)
}

// output runs go with args in dir, the copy, and returns its standard
// output. -trimpath keeps the build cache's entries for the copy valid from
// one temporary directory to the next.
func output(t *testing.T, dir string, env []string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = dir
	cmd.Env = append(slices.DeleteFunc(os.Environ(), func(kv string) bool {
		return strings.HasPrefix(kv, "TEST_MONGO_")
	}), append([]string{"GOFLAGS=-mod=mod -trimpath -buildvcs=false", "GOWORK=off"}, env...)...)
	start := time.Now()
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go %s in the copy: %v\n%s%s", strings.Join(args, " "), err, failure(out), stderr.Bytes())
	}
	t.Logf("go %s: ok in %v", strings.Join(args, " "), time.Since(start).Round(time.Millisecond))
	return string(out)
}

// failure is what a failed go test -v printed about the failure: the
// failing tests, their errors and panics, without the logs of the tests
// around them (or the end of the output when nothing matched).
func failure(out []byte) []byte {
	var keep [][]byte
	for line := range bytes.SplitSeq(out, []byte("\n")) {
		trimmed := bytes.TrimSpace(line)
		switch {
		case bytes.HasPrefix(trimmed, []byte("--- FAIL")), bytes.HasPrefix(trimmed, []byte("FAIL")),
			bytes.HasPrefix(trimmed, []byte("panic:")), bytes.Contains(trimmed, []byte("[build failed]")),
			testError.Match(trimmed) && !bytes.Contains(trimmed, []byte("level=")):
			keep = append(keep, line)
		}
	}
	if len(keep) == 0 {
		lines := bytes.Split(out, []byte("\n"))
		keep = lines[max(0, len(lines)-60):]
	}
	return bytes.Join(keep, []byte("\n"))
}

var testError = regexp.MustCompile(`^\w+_test\.go:\d+: `)
