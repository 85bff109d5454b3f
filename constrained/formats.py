"""Regexes for the JSON Schema `format` values we enforce.

Each regex is a strict subset of its format's grammar (RFC 3339 dates and times, RFC 3986 URIs,
RFC 5321 dot-atom e-mail addresses, ...), chosen so that every string it admits is valid under
the RFC and under the `jsonschema` format checker. Some valid but rare spellings (lowercase `t`
and `z` in date-times, leap seconds, quoted e-mail local parts, IPv6 zone ids) are not generated.
"""

from __future__ import annotations

from radixlm.constrained import regex_text as rt

L = rt.lit


def _date() -> str:
    year = "(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"  # 0001-9999: no year 0
    d31 = "(?:0[1-9]|[12][0-9]|3[01])"
    d30 = "(?:0[1-9]|[12][0-9]|30)"
    d28 = "(?:0[1-9]|1[0-9]|2[0-8])"
    month_day = f"(?:(?:0[13578]|1[02]){L('-')}{d31}|(?:0[469]|11){L('-')}{d30}|02{L('-')}{d28})"
    leap_year = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
    return f"(?:{year}{L('-')}{month_day}|{leap_year}{L('-')}02{L('-')}29)"


def _time() -> str:
    hms = f"(?:[01][0-9]|2[0-3]){L(':')}[0-5][0-9]{L(':')}[0-5][0-9]"
    frac = f"(?:{L('.')}[0-9]+)?"
    offset = f"(?:Z|(?:{L('+')}|{L('-')})(?:[01][0-9]|2[0-3]){L(':')}[0-5][0-9])"
    return hms + frac + offset


_UNRESERVED = rt.union(
    rt.charset((ord("a"), ord("z")), (ord("A"), ord("Z"))), rt.DIGITS, rt.chars("-._~")
)
_SUB_DELIMS = rt.chars("!$&'()*+,;=")
_PCT = f"{L('%')}[0-9A-Fa-f]{{2}}"


def _chars(extra: str = "", sub_delims: bool = True) -> str:
    s = rt.union(_UNRESERVED, _SUB_DELIMS if sub_delims else (), rt.chars(extra))
    return f"(?:{rt.class_regex(s)}|{_PCT})"


def _uri_parts() -> tuple[str, str, str, str]:
    pchar = _chars(":@")
    segment = f"{pchar}*"
    segment_nz = f"{pchar}+"
    path_abempty = f"(?:{L('/')}{segment})*"
    host = f"{_chars()}*"  # reg-name (IP literals are not generated)
    authority = f"(?:{_chars(':')}*{L('@')})?{host}(?:{L(':')}[0-9]*)?"
    hier = (
        f"(?:{L('//')}{authority}{path_abempty}"
        f"|{L('/')}(?:{segment_nz}(?:{L('/')}{segment})*)?"
        f"|{segment_nz}(?:{L('/')}{segment})*)?"
    )
    query = f"(?:{L('?')}{_chars(':@/?')}*)?"
    fragment = f"(?:{L('#')}{_chars(':@/?')}*)?"
    return hier, query, fragment, authority


def _uri() -> str:
    hier, query, fragment, _ = _uri_parts()
    scheme = f"[a-zA-Z](?:[a-zA-Z0-9]|{L('+')}|{L('-')}|{L('.')})*"
    return f"{scheme}{L(':')}{hier}{query}{fragment}"


def _uri_reference() -> str:
    hier, query, fragment, authority = _uri_parts()
    pchar = _chars(":@")
    segment = f"{pchar}*"
    segment_nz_nc = f"{_chars('@')}+"
    relative = (
        f"(?:{L('//')}{authority}(?:{L('/')}{segment})*"
        f"|{L('/')}(?:{pchar}+(?:{L('/')}{segment})*)?"
        f"|{segment_nz_nc}(?:{L('/')}{segment})*)?"
    )
    return f"(?:{_uri()}|{relative}{query}{fragment})"


def _email() -> str:
    atext = rt.class_regex(
        rt.union(
            rt.charset((ord("a"), ord("z")), (ord("A"), ord("Z"))),
            rt.DIGITS,
            rt.chars("!#$%&'*+/=?^_`{|}~-"),
        )
    )
    local = f"{atext}+(?:{L('.')}{atext}+)*"
    label = "[a-zA-Z0-9](?:[a-zA-Z0-9\\x2d]{0,61}[a-zA-Z0-9])?"
    return f"{local}{L('@')}{label}(?:{L('.')}{label})+"


def _hostname() -> str:
    # at most 4 labels of at most 63 characters: 255 > 4*64-1, so the 253 limit always holds
    label = "[a-zA-Z0-9](?:[a-zA-Z0-9\\x2d]{0,61}[a-zA-Z0-9])?"
    return f"{label}(?:{L('.')}{label}){{0,3}}"


def _ipv4() -> str:
    octet = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
    return f"{octet}(?:{L('.')}{octet}){{3}}"


def _ipv6() -> str:
    h16 = "[0-9a-fA-F]{1,4}"
    c = L(":")
    forms = [f"(?:{h16}{c}){{7}}{h16}"]
    # "::" with i groups before and j groups after, i + j <= 7
    for i in range(0, 8):
        for j in range(0, 8 - i):
            before = f"(?:{h16}{c}){{{i - 1}}}{h16}" if i > 1 else (h16 if i == 1 else "")
            after = f"{h16}(?:{c}{h16}){{{j - 1}}}" if j > 1 else (h16 if j == 1 else "")
            forms.append(f"{before}{c}{c}{after}")
    return "(?:" + "|".join(forms) + ")"


def _uuid() -> str:
    h = "[0-9a-fA-F]"
    d = L("-")
    return f"{h}{{8}}{d}{h}{{4}}{d}{h}{{4}}{d}{h}{{4}}{d}{h}{{12}}"


def _duration() -> str:
    n = "[0-9]+"
    time = f"T(?:{n}H(?:{n}M(?:{n}S)?)?|{n}M(?:{n}S)?|{n}S)"
    date = f"(?:{n}D|{n}M(?:{n}D)?|{n}Y(?:{n}M(?:{n}D)?)?)"
    return f"P(?:{date}(?:{time})?|{time}|{n}W)"


# format -> (regex over the string's content, min length, max length); the regexes only use
# characters that need no escaping in JSON, so content regex == encoded regex.
FORMATS: dict[str, tuple[str, int, int | None]] = {
    "date": (_date(), 10, 10),
    "time": (_time(), 9, None),
    "date-time": (f"{_date()}T{_time()}", 20, None),
    "duration": (_duration(), 3, None),
    "email": (_email(), 3, None),
    "hostname": (_hostname(), 1, 255),
    "ipv4": (_ipv4(), 7, 15),
    "ipv6": (_ipv6(), 2, 39),
    "uuid": (_uuid(), 36, 36),
    "uri": (_uri(), 2, None),
    "uri-reference": (_uri_reference(), 0, None),
}

# Formats the JSON Schema specifications define that we do not generate: refused (strict) or
# left to validation (lenient). Any other format is an annotation no validator checks.
UNSUPPORTED_FORMATS = frozenset(
    {
        "idn-email",
        "idn-hostname",
        "iri",
        "iri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
        "regex",
    }
)
