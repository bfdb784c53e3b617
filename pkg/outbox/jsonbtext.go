package outbox

import (
	"errors"
	"fmt"
	"unicode/utf8"
)

// The payload is stored as jsonb and published as jsonb prints it, which is
// not the JSON the writer gave: numbers are PostgreSQL numerics written out
// digit by digit (1e131071 is 8 bytes of JSON and 131,072 bytes of text), a
// space follows every comma and colon, escapes are rewritten. Both relays
// read that text form: the polling relay's claim measures it for its byte
// budget, and the WAL relay receives it from the server's decoding. A text
// form over PostgreSQL's 1 GB limit can never be produced, so a row holding
// one would fail every claim that sees it and stop the WAL stream at it.
// Enqueue therefore bounds the text form, computed here from the payload
// alone, and refuses the numbers PostgreSQL's numeric type refuses.

// Limits of PostgreSQL's numeric type, as jsonb stores numbers.
const (
	// numericMaxIntDigits: a value must be below 10^131072.
	numericMaxIntDigits = 131072
	// numericMaxScale: at most 16383 digits after the decimal point.
	numericMaxScale = 16383
	// numericMaxExponent: the input's exponent must stay within
	// +/-(INT_MAX/2 - 1), even for a zero.
	numericMaxExponent = 1<<30 - 2
)

// maxPayloadTextBytes bounds a payload, as given and as its text form (see
// WriterConfig.MaxPayloadBytes), whatever the Writer's limit, -1 included:
// it is jsonb's own bound on what one value holds (256 MiB), and keeps the
// text a relay reads well under PostgreSQL's 1 GB limit on one value's text.
const maxPayloadTextBytes = 256 << 20

// jsonbTextSize returns the size in bytes of p's text form as jsonb prints it,
// or an error for JSON that jsonb refuses (a lone UTF-16 surrogate, an escaped
// NUL, invalid UTF-8, a number outside numeric's range). p must be valid JSON
// (json.Valid). The size is exact but for duplicate object keys, of which
// jsonb keeps the last: it is then an upper bound.
func jsonbTextSize(p []byte) (int64, error) {
	if !utf8.Valid(p) {
		return 0, errors.New("not valid UTF-8")
	}
	var n int64
	for i := 0; i < len(p); {
		switch c := p[i]; {
		case c == ' ' || c == '\t' || c == '\n' || c == '\r':
			i++
		case c == ',' || c == ':':
			n += 2 // ", " and ": "
			i++
		case c == '"':
			size, end, err := jsonbStringSize(p, i)
			if err != nil {
				return 0, err
			}
			n += size
			i = end
		case c == '-' || (c >= '0' && c <= '9'):
			size, end, err := jsonbNumberSize(p, i)
			if err != nil {
				return 0, err
			}
			n += size
			i = end
		default: // brackets, braces, and the letters of true, false, null
			n++
			i++
		}
	}
	return n, nil
}

// jsonbStringSize measures the string that starts at p[i] (its opening quote)
// as jsonb prints it: escapes decoded, then ", \ and control characters
// escaped again (\b \f \n \r \t, others as \u00XX). It returns the index past
// the closing quote.
func jsonbStringSize(p []byte, i int) (size int64, end int, err error) {
	size = 2 // the quotes
	for i++; i < len(p); {
		c := p[i]
		switch {
		case c == '"':
			return size, i + 1, nil
		case c != '\\':
			size++
			i++
			continue
		}
		if i+1 >= len(p) {
			break
		}
		switch e := p[i+1]; e {
		case '"', '\\', 'b', 'f', 'n', 'r', 't':
			size += 2
			i += 2
		case '/':
			size++
			i += 2
		case 'u':
			if i+6 > len(p) {
				return 0, 0, errors.New(`a \u escape is cut short`)
			}
			r := hex4(p[i+2 : i+6])
			i += 6
			switch {
			case r >= 0xD800 && r < 0xDC00: // high surrogate: a low one must follow
				if i+6 > len(p) || p[i] != '\\' || p[i+1] != 'u' {
					return 0, 0, errors.New(`a \u escape holds a UTF-16 high surrogate with no low one after it, which PostgreSQL refuses`)
				}
				if lo := hex4(p[i+2 : i+6]); lo < 0xDC00 || lo > 0xDFFF {
					return 0, 0, errors.New(`a \u escape holds a UTF-16 high surrogate with no low one after it, which PostgreSQL refuses`)
				}
				size += 4
				i += 6
			case r >= 0xDC00 && r <= 0xDFFF:
				return 0, 0, errors.New(`a \u escape holds a UTF-16 low surrogate with no high one before it, which PostgreSQL refuses`)
			case r == 0:
				return 0, 0, errors.New(`contains \u0000, which PostgreSQL cannot store`)
			case r == '"' || r == '\\' || r == '\b' || r == '\f' || r == '\n' || r == '\r' || r == '\t':
				size += 2
			case r < 0x20:
				size += 6
			default:
				size += int64(utf8.RuneLen(r))
			}
		default:
			return 0, 0, fmt.Errorf("invalid escape \\%c", e)
		}
	}
	return 0, 0, errors.New("unterminated string")
}

// hex4 reads four hex digits (json.Valid checked them).
func hex4(b []byte) rune {
	var r rune
	for _, c := range b {
		r <<= 4
		switch {
		case c >= '0' && c <= '9':
			r |= rune(c - '0')
		case c >= 'a' && c <= 'f':
			r |= rune(c - 'a' + 10)
		case c >= 'A' && c <= 'F':
			r |= rune(c - 'A' + 10)
		}
	}
	return r
}

// jsonbNumberSize measures the number that starts at p[i] as PostgreSQL's
// numeric prints it: in positional notation, with every integer digit and as
// many decimals as the input's fraction had, less its exponent. It returns
// the index past the number, or an error when numeric refuses the value.
func jsonbNumberSize(p []byte, i int) (size int64, end int, err error) {
	neg := p[i] == '-'
	if neg {
		i++
	}
	intStart := i
	for i < len(p) && p[i] >= '0' && p[i] <= '9' {
		i++
	}
	intDigits := p[intStart:i]
	var fracDigits []byte
	if i < len(p) && p[i] == '.' {
		i++
		s := i
		for i < len(p) && p[i] >= '0' && p[i] <= '9' {
			i++
		}
		fracDigits = p[s:i]
	}
	var exp int64
	if i < len(p) && (p[i] == 'e' || p[i] == 'E') {
		i++
		expNeg := false
		if i < len(p) && (p[i] == '+' || p[i] == '-') {
			expNeg = p[i] == '-'
			i++
		}
		for ; i < len(p) && p[i] >= '0' && p[i] <= '9'; i++ {
			if exp <= numericMaxExponent { // saturate: anything past it is refused
				exp = exp*10 + int64(p[i]-'0')
			}
		}
		if expNeg {
			exp = -exp
		}
	}
	if exp > numericMaxExponent || exp < -numericMaxExponent {
		return 0, 0, errors.New("a number's exponent is outside the range of PostgreSQL's numeric")
	}
	scale := max(int64(len(fracDigits))-exp, 0)
	if scale > numericMaxScale {
		return 0, 0, fmt.Errorf("a number has %d digits after the decimal point, more than the %d of PostgreSQL's numeric", scale, numericMaxScale)
	}
	// The power of ten of the first significant digit.
	lead, zero := int64(0), true
	for k, d := range intDigits {
		if d != '0' {
			lead, zero = int64(len(intDigits)-1-k)+exp, false
			break
		}
	}
	if zero {
		for k, d := range fracDigits {
			if d != '0' {
				lead, zero = -int64(k+1)+exp, false
				break
			}
		}
	}
	intLen := int64(1) // "0"
	if !zero && lead >= 0 {
		if lead >= numericMaxIntDigits {
			return 0, 0, fmt.Errorf("a number has %d digits before the decimal point, more than the %d of PostgreSQL's numeric", lead+1, numericMaxIntDigits)
		}
		intLen = lead + 1
	}
	size = intLen
	if scale > 0 {
		size += 1 + scale
	}
	if neg && !zero {
		size++
	}
	return size, i, nil
}
