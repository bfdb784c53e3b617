package copycheck

import (
	"bytes"
	"context"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// thisModule is the module path the packages have in this repository.
const thisModule = "github.com/outbox-inbox/reference"

// TestPackagesCopyIntoAModuleOfTheirOwn copies each package directory (with
// its subpackages and tests) into a scratch module whose go.mod requires
// the versions this repository's go.mod does, rewrites the package's own
// import path, and runs go build, go vet and the package's examples there,
// with -mod=mod against the local module cache (and GOPROXY as the
// environment sets it). A copy that still imports anything of this
// repository (say, its internal test helpers) fails: nothing provides it.
func TestPackagesCopyIntoAModuleOfTheirOwn(t *testing.T) {
	if testing.Short() {
		t.Skip("copycheck: compiles two modules; not in -short")
	}
	gomod := goEnv(t, "GOMOD")
	root := filepath.Dir(gomod)
	mod, err := os.ReadFile(gomod)
	if err != nil {
		t.Fatal(err)
	}
	sum, err := os.ReadFile(filepath.Join(root, "go.sum"))
	if err != nil {
		t.Fatal(err)
	}
	for _, pkg := range []string{"pkg/outbox", "pkg/inbox"} {
		t.Run(pkg, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			const copyModule = "example.com/copy"
			copyTree(t, filepath.Join(root, pkg), dir, thisModule+"/"+pkg, copyModule)
			if err := os.WriteFile(filepath.Join(dir, "go.mod"), scratchGoMod(mod, copyModule), 0o644); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(dir, "go.sum"), sum, 0o644); err != nil {
				t.Fatal(err)
			}
			for _, args := range [][]string{
				{"build", "./..."},
				{"vet", "./..."},
				{"test", "-count=1", "-run", "Example", "./..."},
			} {
				run(t, dir, args...)
			}
			// The packages may use the OpenTelemetry API (outbox/outboxotel
			// does) but never its SDK, which is the application's choice.
			// What a user's build pulls in are the deps of the importable
			// packages (their internal packages included); the internal
			// test helpers are left out (inbox's embeds FerretDB, which
			// brings the SDK into the tests only).
			listArgs := []string{"list", "-deps"}
			for _, p := range strings.Fields(output(t, dir, "list", "./...")) {
				if !strings.Contains(p+"/", "/internal/") {
					listArgs = append(listArgs, p)
				}
			}
			for _, dep := range strings.Fields(output(t, dir, listArgs...)) {
				if strings.HasPrefix(dep, "go.opentelemetry.io/otel/sdk") || strings.HasPrefix(dep, "go.opentelemetry.io/otel/exporters") {
					t.Errorf("%s imports %s (the OpenTelemetry SDK is for applications, not for these packages)", pkg, dep)
				}
			}
		})
	}
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

var moduleLine = regexp.MustCompile(`(?m)^module .*$`)

// scratchGoMod is this repository's go.mod under another module path: the
// same go version and the same required versions.
func scratchGoMod(mod []byte, module string) []byte {
	return moduleLine.ReplaceAll(mod, []byte("module "+module))
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

func run(t *testing.T, dir string, args ...string) {
	t.Helper()
	output(t, dir, args...)
}

// output runs go with args in dir, the copy, and returns its standard output.
func output(t *testing.T, dir string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GOFLAGS=-mod=mod -buildvcs=false", "GOWORK=off")
	start := time.Now()
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go %s in the copy: %v\n%s%s", strings.Join(args, " "), err, out, stderr.Bytes())
	}
	t.Logf("go %s: ok in %v", strings.Join(args, " "), time.Since(start).Round(time.Millisecond))
	return string(out)
}
