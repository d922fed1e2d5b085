#include "tq/status.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>

namespace tq {
namespace {

Result<int> Half(int v) {
  if (v % 2 != 0) return InvalidArgumentError("odd value " + std::to_string(v));
  return v / 2;
}

Status UseAssign(int v, int* out) {
  TQ_ASSIGN_OR_RETURN(*out, Half(v));
  return Status::Ok();
}

TEST(StatusTest, OkAndErrorsCarryCodeAndMessage) {
  EXPECT_TRUE(Status::Ok().ok());
  const Status s = OutOfRangeError("slot 9 >= 8");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange);
  EXPECT_EQ(s.ToString(), "OutOfRange: slot 9 >= 8");
}

TEST(StatusTest, ResultHoldsValueOrStatus) {
  Result<int> a = Half(8);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(*a, 4);
  Result<int> b = Half(3);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument);
  int out = 0;
  EXPECT_TRUE(UseAssign(10, &out).ok());
  EXPECT_EQ(out, 5);
  EXPECT_EQ(UseAssign(7, &out).code(), StatusCode::kInvalidArgument);
}

TEST(StatusTest, ResultFromOkStatusIsAnInternalError) {
  Result<int> r{Status::Ok()};
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
}

TEST(StatusTest, ResultMovesNonCopyableValues) {
  Result<std::unique_ptr<int>> r{std::make_unique<int>(42)};
  ASSERT_TRUE(r.ok());
  std::unique_ptr<int> p = std::move(r).value();
  EXPECT_EQ(*p, 42);
}

}  // namespace
}  // namespace tq
