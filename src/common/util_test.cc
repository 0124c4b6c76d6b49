#include "common/util.h"

#include <gtest/gtest.h>

#include <vector>

namespace esb {
namespace {

TEST(UtilTest, Rfc3339RoundTrips) {
  int64_t ms = 1795321800123;  // 2026-11-22T04:30:00.123Z
  std::string s = FormatRfc3339(ms);
  EXPECT_EQ(s, "2026-11-22T04:30:00.123Z");
  int64_t back = 0;
  ASSERT_TRUE(ParseTime(s, &back));
  EXPECT_EQ(back, ms);
}

TEST(UtilTest, ParseTimeHonoursOffsetsAndRejectsJunk) {
  int64_t a = 0, b = 0;
  ASSERT_TRUE(ParseTime("2026-11-22T06:30:00+02:00", &a));
  ASSERT_TRUE(ParseTime("2026-11-22T04:30:00Z", &b));
  EXPECT_EQ(a, b);
  ASSERT_TRUE(ParseTime("1795321800", &a));
  EXPECT_EQ(a, b);
  EXPECT_FALSE(ParseTime("yesterday", &a));
  EXPECT_FALSE(ParseTime("2026-11-22T04:30:00", &a));  // no zone
  EXPECT_FALSE(ParseTime("", &a));
}

TEST(UtilTest, ErrnoStatusMapsCodes) {
  EXPECT_TRUE(absl::IsNotFound(ErrnoStatus("open x", ENOENT)));
  EXPECT_TRUE(absl::IsPermissionDenied(ErrnoStatus("open x", EACCES)));
  EXPECT_TRUE(absl::IsResourceExhausted(ErrnoNameStatus("ENOSPC", "full")));
  EXPECT_NE(ErrnoStatus("open /x", ENOENT).message().find("/x"), std::string::npos);
  // A socket, a device without a driver or a terminal that is not ours is bad input (400),
  // never a server fault (files/read of a socket or /dev/tty answered 500).
  for (const char* name : {"ENXIO", "ENODEV", "EOPNOTSUPP", "ELOOP"}) {
    EXPECT_TRUE(absl::IsInvalidArgument(ErrnoNameStatus(name, "x"))) << name;
  }
  EXPECT_TRUE(absl::IsInvalidArgument(ErrnoStatus("open /dev/tty", ENXIO)));
  EXPECT_TRUE(absl::IsFailedPrecondition(ErrnoNameStatus("ENOTEMPTY", "x")));
}

// The one errno → Status table (the API turns codes into HTTP: NotFound 404, PermissionDenied
// 403, ResourceExhausted 507, InvalidArgument 400, ...). Both tiers report errno names (the
// agent and the nano worker), so the same error answers the same HTTP code on both; the nano
// driver used to answer EPERM and ENOMEM with 400.
TEST(UtilTest, OneErrnoTableForNumbersAndNames) {
  const struct {
    const char* name;
    int err;
    absl::StatusCode code;
  } kTable[] = {
      {"ENOENT", ENOENT, absl::StatusCode::kNotFound},
      {"EACCES", EACCES, absl::StatusCode::kPermissionDenied},
      {"EPERM", EPERM, absl::StatusCode::kPermissionDenied},
      {"EROFS", EROFS, absl::StatusCode::kPermissionDenied},
      {"EEXIST", EEXIST, absl::StatusCode::kAlreadyExists},
      {"ENOSPC", ENOSPC, absl::StatusCode::kResourceExhausted},
      {"EDQUOT", EDQUOT, absl::StatusCode::kResourceExhausted},
      {"EFBIG", EFBIG, absl::StatusCode::kResourceExhausted},
      {"ENOMEM", ENOMEM, absl::StatusCode::kResourceExhausted},
      {"EINVAL", EINVAL, absl::StatusCode::kInvalidArgument},
      {"EISDIR", EISDIR, absl::StatusCode::kInvalidArgument},
      {"ENOTDIR", ENOTDIR, absl::StatusCode::kInvalidArgument},
      {"ENAMETOOLONG", ENAMETOOLONG, absl::StatusCode::kInvalidArgument},
      {"ENOTEMPTY", ENOTEMPTY, absl::StatusCode::kFailedPrecondition},
      {"ETIMEDOUT", ETIMEDOUT, absl::StatusCode::kDeadlineExceeded},
      {"EAGAIN", EAGAIN, absl::StatusCode::kUnavailable},
      {"EBUSY", EBUSY, absl::StatusCode::kUnavailable},
      // By name it used to be missing (a 500) while its number answered 503.
      {"ECONNREFUSED", ECONNREFUSED, absl::StatusCode::kUnavailable},
      // The agent's process ops: an exited process, closed input, a cancelled wait, too many
      // open files. ESRCH used to fall through to Internal (500, and a terminal that closed
      // without its exit status when typed-ahead input met an exited shell).
      {"ESRCH", ESRCH, absl::StatusCode::kNotFound},
      {"EPIPE", EPIPE, absl::StatusCode::kFailedPrecondition},
      {"ECANCELED", ECANCELED, absl::StatusCode::kCancelled},
      {"EMFILE", EMFILE, absl::StatusCode::kResourceExhausted},
  };
  for (const auto& row : kTable) {
    absl::Status by_name = ErrnoNameStatus(row.name, "msg");
    EXPECT_EQ(by_name.code(), row.code) << row.name;
    EXPECT_EQ(by_name.message(), "msg") << row.name;
    absl::Status by_number = ErrnoStatus("op", row.err);
    EXPECT_EQ(by_number.code(), row.code) << row.name;
    EXPECT_NE(by_number.message().find(row.name), absl::string_view::npos) << by_number;
  }
  // A name nobody knows (a guest's WASI code, a newer agent's) is the server's fault to
  // explain, not the caller's: 500 with the peer's message.
  EXPECT_TRUE(absl::IsInternal(ErrnoNameStatus("WASI_ERRNO_8", "badf")));
  EXPECT_TRUE(absl::IsInternal(ErrnoNameStatus("", "no errno")));
}

TEST(UtilTest, HttpStatusForMapsEveryCode) {
  EXPECT_EQ(HttpStatusFor(absl::OkStatus()), 200);
  EXPECT_EQ(HttpStatusFor(absl::InvalidArgumentError("x")), 400);
  EXPECT_EQ(HttpStatusFor(absl::OutOfRangeError("x")), 400);
  EXPECT_EQ(HttpStatusFor(absl::FailedPreconditionError("x")), 400);
  EXPECT_EQ(HttpStatusFor(absl::PermissionDeniedError("x")), 400);
  EXPECT_EQ(HttpStatusFor(absl::UnimplementedError("x")), 400);
  EXPECT_EQ(HttpStatusFor(absl::UnauthenticatedError("x")), 401);
  EXPECT_EQ(HttpStatusFor(absl::NotFoundError("x")), 404);
  EXPECT_EQ(HttpStatusFor(absl::AlreadyExistsError("x")), 409);
  EXPECT_EQ(HttpStatusFor(absl::AbortedError("x")), 409);
  EXPECT_EQ(HttpStatusFor(absl::ResourceExhaustedError("x")), 429);
  EXPECT_EQ(HttpStatusFor(absl::CancelledError("x")), 499);
  EXPECT_EQ(HttpStatusFor(absl::UnavailableError("x")), 503);
  EXPECT_EQ(HttpStatusFor(absl::DeadlineExceededError("x")), 503);
  EXPECT_EQ(HttpStatusFor(absl::InternalError("x")), 500);
  EXPECT_EQ(HttpStatusFor(absl::DataLossError("x")), 500);
  EXPECT_EQ(HttpStatusFor(absl::UnknownError("x")), 500);
}

TEST(UtilTest, RandomHexIsHexAndDiffers) {
  std::string a = RandomHex(16), b = RandomHex(16);
  EXPECT_EQ(a.size(), 32u);
  EXPECT_NE(a, b);
  EXPECT_EQ(a.find_first_not_of("0123456789abcdef"), std::string::npos);
}

TEST(UtilTest, LogThrottleLogsPowersOfTwoWithTheCount) {
  LogThrottle t;
  std::vector<uint64_t> logged;
  for (int i = 0; i < 1000; ++i) {
    if (uint64_t n = t.Hit()) logged.push_back(n);
  }
  EXPECT_EQ(logged, (std::vector<uint64_t>{1, 2, 4, 8, 16, 32, 64, 128, 256, 512}));
}

}  // namespace
}  // namespace esb
