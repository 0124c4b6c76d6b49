#include "governance/dlp/validators.h"

#include <gtest/gtest.h>

namespace esb::governance::dlp {
namespace {

TEST(DlpValidatorsTest, Luhn) {
  EXPECT_TRUE(LuhnValid("4111111111111111"));
  EXPECT_TRUE(LuhnValid("79927398713"));
  EXPECT_FALSE(LuhnValid("79927398710"));
  EXPECT_FALSE(LuhnValid("4111111111111112"));
  EXPECT_FALSE(LuhnValid("0"));
}

TEST(DlpValidatorsTest, CardNumbers) {
  EXPECT_TRUE(CardNumberValid("4111 1111 1111 1111"));
  EXPECT_TRUE(CardNumberValid("3782 822463 10005"));     // Amex 4-6-5
  EXPECT_TRUE(CardNumberValid("3530111333300000"));      // JCB
  EXPECT_TRUE(CardNumberValid("36227206271667"));        // Diners, 14 digits
  EXPECT_FALSE(CardNumberValid("4111111111111112"));     // Luhn
  EXPECT_FALSE(CardNumberValid("1234567812345670"));     // no network
  EXPECT_FALSE(CardNumberValid("5555555555554444000"));  // Mastercard is 16 digits
  EXPECT_FALSE(CardNumberValid("4111 1111-1111 1111"));  // mixed separators
  EXPECT_FALSE(CardNumberValid("4111  1111 1111 1111"));
}

TEST(DlpValidatorsTest, Iban) {
  EXPECT_TRUE(IbanValid("DE89370400440532013000"));
  EXPECT_TRUE(IbanValid("GB82 WEST 1234 5698 7654 32"));
  EXPECT_TRUE(IbanValid("FR1420041010050500013M02606"));
  EXPECT_TRUE(IbanValid("NO9386011117947"));
  EXPECT_FALSE(IbanValid("DE89370400440532013001"));  // check digits
  EXPECT_FALSE(IbanValid("DE8937040044053201300"));   // length for DE
  EXPECT_FALSE(IbanValid("XX89370400440532013000"));  // country
  EXPECT_FALSE(IbanValid("de89370400440532013000"));
  EXPECT_EQ(IbanLength("DE"), 22);
  EXPECT_EQ(IbanLength("US"), 0);
}

TEST(DlpValidatorsTest, Ssn) {
  EXPECT_TRUE(SsnValid("536-22-8745"));
  EXPECT_TRUE(SsnValid("899-01-0001"));
  EXPECT_FALSE(SsnValid("000-22-8745"));
  EXPECT_FALSE(SsnValid("666-22-8745"));
  EXPECT_FALSE(SsnValid("900-22-8745"));
  EXPECT_FALSE(SsnValid("999-22-8745"));
  EXPECT_FALSE(SsnValid("536-00-8745"));
  EXPECT_FALSE(SsnValid("536-22-0000"));
  EXPECT_FALSE(SsnValid("078-05-1120"));
  EXPECT_FALSE(SsnValid("219-09-9999"));
  EXPECT_FALSE(SsnValid("53622874"));
}

TEST(DlpValidatorsTest, EntropyAndJwtHeader) {
  EXPECT_DOUBLE_EQ(ShannonEntropy("aaaa"), 0.0);
  EXPECT_DOUBLE_EQ(ShannonEntropy("abcd"), 2.0);
  EXPECT_TRUE(JwtHeaderValid("eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.x.y"));
  EXPECT_FALSE(JwtHeaderValid("eyJub3RhIjoiaGVhZGVyIn0.x.y"));
  EXPECT_FALSE(JwtHeaderValid("!!!.x.y"));
}

}  // namespace
}  // namespace esb::governance::dlp
