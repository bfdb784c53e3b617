// Package doccheck reads the repository's Markdown the way GitHub renders it,
// so that a test can walk every relative link of README.md and docs/*.md and
// fail on a missing file or heading anchor, and refuse sentences that tell
// how the repository was made rather than what it does.
//
// It knows the subset of Markdown the repository uses: ATX headings (# to
// ######), inline links and images, reference definitions, fenced code
// blocks and code spans (whose contents are never links). External links
// (any URL scheme) are left alone: the test makes no network call.
package doccheck

import (
	"regexp"
	"strconv"
	"strings"
	"unicode"
)

// Slug is the anchor GitHub gives a heading whose rendered text is text:
// lower case, every character that is not a letter, a digit, a space, a
// hyphen or an underscore dropped, each space turned into a hyphen.
func Slug(text string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(text) {
		switch {
		case r == ' ':
			b.WriteByte('-')
		case r == '-' || r == '_':
			b.WriteRune(r)
		case unicode.IsLetter(r) || unicode.IsDigit(r) || unicode.IsMark(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

var (
	atxHeading  = regexp.MustCompile(`^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$`)
	inlineLink  = regexp.MustCompile(`!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*(<[^>\n]*>|[^)\s]+)(?:\s+(?:"[^"]*"|'[^']*'|\([^)]*\)))?\s*\)`)
	refDef      = regexp.MustCompile(`(?m)^ {0,3}\[[^\]]+\]:\s*(<[^>\n]*>|\S+)`)
	htmlID      = regexp.MustCompile(`<[a-zA-Z][^>]*\s(?:id|name)="([^"]+)"`)
	fenceOpen   = regexp.MustCompile("^ {0,3}(`{3,}|~{3,})")
	emphasis    = strings.NewReplacer("`", "", "*", "")
	headingLink = regexp.MustCompile(`!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)`)
	htmlTag     = regexp.MustCompile(`</?[a-zA-Z][^>]*>`)
)

// blankCode returns md with the contents of fenced code blocks and code
// spans replaced by spaces, newlines kept, so offsets and line numbers stay
// those of md and nothing in code is taken for a link or a heading.
func blankCode(md string) string {
	out := []byte(md)
	blank := func(from, to int) {
		for i := from; i < to; i++ {
			if out[i] != '\n' {
				out[i] = ' '
			}
		}
	}
	// Fenced blocks, line by line.
	var fence string
	start := 0
	for start < len(md) {
		end := strings.IndexByte(md[start:], '\n')
		if end < 0 {
			end = len(md)
		} else {
			end += start
		}
		line := md[start:end]
		switch {
		case fence != "":
			blank(start, end)
			if t := strings.TrimSpace(line); strings.HasPrefix(t, fence) && strings.Trim(t, fence[:1]) == "" {
				fence = ""
			}
		default:
			if m := fenceOpen.FindStringSubmatch(line); m != nil {
				fence = m[1]
				blank(start, end)
			}
		}
		start = end + 1
	}
	// Code spans: a run of n backticks up to the next run of exactly n.
	s := string(out)
	for i := 0; i < len(s); {
		if s[i] != '`' {
			i++
			continue
		}
		n := 0
		for i+n < len(s) && s[i+n] == '`' {
			n++
		}
		closeAt := -1
		for j := i + n; j < len(s); {
			if s[j] != '`' {
				j++
				continue
			}
			m := 0
			for j+m < len(s) && s[j+m] == '`' {
				m++
			}
			if m == n {
				closeAt = j
				break
			}
			j += m
		}
		if closeAt < 0 {
			i += n
			continue
		}
		blank(i, closeAt+n)
		i = closeAt + n
	}
	return string(out)
}

// Heading is one ATX heading: its line and the anchor GitHub gives it.
type Heading struct {
	Line   int
	Text   string
	Anchor string
}

// Headings lists md's headings in order, with GitHub's anchors: a heading
// whose slug was already given gets -1, then -2, and so on.
func Headings(md string) []Heading {
	code := blankCode(md)
	seen := map[string]int{}
	var hs []Heading
	lines := strings.Split(md, "\n")
	codeLines := strings.Split(code, "\n")
	for i, line := range lines {
		if strings.TrimSpace(codeLines[i]) == "" && strings.TrimSpace(line) != "" {
			continue // inside a fenced block
		}
		m := atxHeading.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		text := headingLink.ReplaceAllString(m[2], "$1")
		text = htmlTag.ReplaceAllString(text, "")
		text = strings.TrimSpace(emphasis.Replace(text))
		hs = append(hs, Heading{Line: i + 1, Text: text, Anchor: unique(seen, Slug(text))})
	}
	return hs
}

// unique is github-slugger's rule for repeated slugs.
func unique(seen map[string]int, slug string) string {
	result := slug
	for {
		if _, taken := seen[result]; !taken {
			break
		}
		seen[slug]++
		result = slug + "-" + strconv.Itoa(seen[slug])
	}
	seen[result] = 0
	return result
}

// Anchors is the set of fragments a link into md may name: its headings'
// anchors and the id or name attributes of its HTML elements.
func Anchors(md string) map[string]bool {
	a := map[string]bool{}
	for _, h := range Headings(md) {
		a[h.Anchor] = true
	}
	for _, m := range htmlID.FindAllStringSubmatch(blankCode(md), -1) {
		a[m[1]] = true
	}
	return a
}

// Link is a link's destination and the line it starts on.
type Link struct {
	Line   int
	Target string
}

// Links lists the destinations of md's inline links, images and reference
// definitions, outside code.
func Links(md string) []Link {
	code := blankCode(md)
	var ls []Link
	add := func(at int, target string) {
		target = strings.TrimSuffix(strings.TrimPrefix(target, "<"), ">")
		ls = append(ls, Link{Line: 1 + strings.Count(code[:at], "\n"), Target: target})
	}
	for _, m := range inlineLink.FindAllStringSubmatchIndex(code, -1) {
		add(m[0], code[m[4]:m[5]])
	}
	for _, m := range refDef.FindAllStringSubmatchIndex(code, -1) {
		add(m[0], code[m[2]:m[3]])
	}
	return ls
}

var scheme = regexp.MustCompile(`^[a-zA-Z][a-zA-Z0-9+.-]*:`)

// External reports whether target leaves the repository: a URL with a
// scheme (https:, mailto:) or a protocol-relative one.
func External(target string) bool {
	return scheme.MatchString(target) || strings.HasPrefix(target, "//")
}

// Phrase is a kind of sentence the repository does not contain, and why.
type Phrase struct {
	Pattern *regexp.Regexp
	Why     string
}

// Forbidden are sentences about how the repository was made, which belong in
// commit messages: the docs and comments say what the code does and what was
// verified (docs/verification.md), not who looked at it or where it was
// written.
var Forbidden = []Phrase{
	{regexp.MustCompile(`(?i)\bthis\s+round\b`), "a round of work is the history of a change: say it in the commit message"},
	{regexp.MustCompile(`(?i)\bdev(elopment)?\s+machine\b`), "say what ran where in docs/verification.md, with its date and commit"},
	{regexp.MustCompile(`(?i)\bthe\s+reviewers?\b`), "a review is the history of a change: say it in the commit message"},
	{regexp.MustCompile(`(?i)\bmachine\s+(this|it)\s+was\s+built\s+on\b`), "say what ran where in docs/verification.md, with its date and commit"},
	{regexp.MustCompile(`(?i)\bthis\s+project\s+is\s+built\s+on\b`), "say what ran where in docs/verification.md, with its date and commit"},
}

// commentBreak joins lines so that a phrase split by a line break, inside a
// comment (//, #) or not, is still one phrase.
var commentBreak = regexp.MustCompile(`[ \t]*\r?\n[ \t]*(?://+|#+)?[ \t]*`)

// Find returns, for each forbidden phrase in text, the line it starts on
// and the words matched.
func Find(text string) []Found {
	// Map offsets in the joined text back to lines.
	var lineAt []int
	var joined strings.Builder
	line := 1
	last := 0
	for _, m := range commentBreak.FindAllStringIndex(text, -1) {
		for i := last; i < m[0]; i++ {
			joined.WriteByte(text[i])
			lineAt = append(lineAt, line)
		}
		joined.WriteByte(' ')
		lineAt = append(lineAt, line)
		line++
		last = m[1]
	}
	for i := last; i < len(text); i++ {
		joined.WriteByte(text[i])
		lineAt = append(lineAt, line)
	}
	j := joined.String()
	var fs []Found
	for _, p := range Forbidden {
		for _, m := range p.Pattern.FindAllStringIndex(j, -1) {
			fs = append(fs, Found{Line: lineAt[m[0]], Text: j[m[0]:m[1]], Why: p.Why})
		}
	}
	return fs
}

// Found is one forbidden phrase in a file.
type Found struct {
	Line int
	Text string
	Why  string
}
